"""The LiveAssistant run (livemoe.train.live): the data (the synthetic world or --data sessions), MA-MSFT and
SM-GSPO in turn from the same model, each stage evaluated on held-out sessions played through a LiveSession, the
table and results.json; and --replay, one held-out session decided interval by interval."""
import dataclasses
import json
import os
import sys
import time

import torch

from livemoe.engine import LLM, load_model, load_tokenizer, save_model
from livemoe.train.config import config_dict, save_config
from livemoe.train.live.config import LiveConfig
from livemoe.train.live.data import load_sessions
from livemoe.train.live.evaluate import evaluate, play
from livemoe.train.live.gspo import train_gspo
from livemoe.train.live.judge import paired_margin
from livemoe.train.live.media_world import media_session
from livemoe.train.live.msft import train_msft
from livemoe.train.live.world import LiveWorldConfig, decision_text, make_sessions
from livemoe.train.metrics import MetricsLogger

COLUMNS = [("state", "state acc"), ("recipient", "recipient acc"), ("task", "task acc"), ("grounding", "grounding"),
           ("trajectory_reward", "traj reward"), ("latency_ms", "latency ms"), ("decode_gflops", "decode GFLOPs")]


def log(msg: str) -> None:
    print(f"[live] {msg}", flush=True)


def format_table(rows: dict) -> str:
    """The rows as a markdown table; the accuracies as "value ± standard error" (judge.accuracy)."""
    def cell(r, k):
        if k in ("decode_gflops", "trajectory_reward"):
            return f"{r[k]:.4f}"
        return f"{r[k]:.2f} ± {r[k + '_se']:.2f}" if k + "_se" in r else f"{r[k]:.2f}"

    head = "| stage | " + " | ".join(c for _, c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for stage, r in rows.items():
        lines.append(f"| {stage} | " + " | ".join(cell(r, k) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def format_margins(rows: dict) -> str:
    """Each stage against the one before it on the same held-out intervals: the paired difference in
    state, recipient and task accuracy (% points) ± its standard error (judge.paired_margin)."""
    names = list(rows)
    lines = ["| stage vs the one before | state | recipient | task |", "|---|---|---|---|"]
    for a, b in zip(names, names[1:]):
        cells = []
        for k in ("state", "recipient", "task"):
            m, se = paired_margin(rows[a]["outcomes"][k], rows[b]["outcomes"][k])
            cells.append(f"{m:+.2f} ± {se:.2f}")
        lines.append(f"| {b} vs {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_data(cfg: LiveConfig) -> tuple:
    """(MA-MSFT's training sessions, held-out sessions, SM-GSPO's sessions: MA-MSFT's unless --gspo_sessions)."""
    world = LiveWorldConfig(num_intervals=cfg.num_intervals, **({} if cfg.unrecorded_courtesy is None else
                                                                {"p_unrecorded_courtesy": cfg.unrecorded_courtesy}))
    def synthetic(n, seed, split):
        sessions = make_sessions(n, seed, world, split)
        if cfg.media_mode is None:
            return sessions
        return [media_session(s, cfg.media_cache, cfg.media_mode) for s in sessions]

    train = load_sessions(cfg.data) if cfg.data else synthetic(cfg.train_sessions, cfg.seed, "train")
    held = (load_sessions(cfg.eval_data) if cfg.eval_data else synthetic(cfg.eval_sessions, cfg.seed + 10_000, "heldout"))
    rl = synthetic(cfg.gspo_sessions, cfg.seed + 20_000, "rl") if cfg.gspo_sessions else train
    return train, held, rl


def engine_for(model, tokenizer) -> LLM:
    return LLM.from_model(model, tokenizer, use_tqdm=False, num_kv_blocks=512)


def replay(cfg: LiveConfig) -> None:
    _, held, _ = load_data(cfg)
    model, tok = load_model(cfg.replay), load_tokenizer(cfg.replay)
    llm = engine_for(model, tok)
    session = held[0]
    print(f"session {session['id']}: {len(session['intervals'])} intervals\n{session['system']}\n", flush=True)

    def show(i, iv, d):
        m = d.metrics
        for e in iv["events"]:
            print(f"  {e}")
        print(f"t={iv.get('t', (i + 1) * 10)}s -> {d.text}    (gold: {decision_text(iv)}; "
              f"{m.latency_s * 1000:.1f} ms, prompt {m.prompt_tokens} of which cached {m.cached_prompt_tokens}, "
              f"{m.completion_tokens} tokens{', compacted' if m.compacted else ''})", flush=True)

    play(llm, session, cfg.gspo.max_message_chars, on_step=show)


def _save(model, tokenizer, path: str) -> None:
    save_model(model, path)
    tokenizer.save_pretrained(path)


def run(cfg: LiveConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    os.makedirs(cfg.output_dir, exist_ok=True)
    save_config(cfg, cfg.output_dir)
    t_start, cpu_start = time.time(), time.process_time()
    train, held, rl = load_data(cfg)
    tokenizer = load_tokenizer(cfg.model)
    if tokenizer is None:
        raise ValueError(f"{cfg.model}: the checkpoint has no tokenizer")
    model = load_model(cfg.model, device=device)
    log(f"{len(train)} training sessions, {len(held)} held-out sessions of "
        f"{sum(len(s['intervals']) for s in held)} intervals"
        + (f", {len(rl)} fresh sessions for SM-GSPO" if rl is not train else ""))
    rows = {}

    def evaluate_stage(name):
        t0 = time.time()
        rows[name] = evaluate(engine_for(model, tokenizer), held, cfg.gspo.max_message_chars)
        log(f"{name}: " + ", ".join(f"{c} {rows[name][k]:.3f}" for k, c in COLUMNS) + f" ({time.time() - t0:.0f}s)")

    start_name = "base student" if cfg.stage != "gspo" else "start (--model)"
    evaluate_stage(start_name)
    sft_opts = dataclasses.replace(cfg.msft, seed=cfg.seed)  # one --seed for the data and both stages
    if cfg.stage in ("sft", "all") and cfg.compare_plain:
        base_state = {k: v.clone() for k, v in model.state_dict().items()}
        plain = dataclasses.replace(sft_opts, marker_weight=1.0, recipient_weight=1.0, balance=0.0)
        _stage_train(cfg, "plain_msft", lambda on_step: train_msft(model, tokenizer, train, plain, log, on_step))
        evaluate_stage("plain multi-turn SFT")
        model.load_state_dict(base_state)
    if cfg.stage in ("sft", "all"):
        _stage_train(cfg, "msft", lambda on_step: train_msft(model, tokenizer, train, sft_opts, log, on_step))
        _save(model, tokenizer, os.path.join(cfg.output_dir, "msft", "model"))
        evaluate_stage("MA-MSFT")
    if cfg.stage in ("gspo", "all"):
        opts = dataclasses.replace(cfg.gspo, seed=cfg.seed)
        _stage_train(cfg, "gspo", lambda on_step: train_gspo(model, tokenizer, rl, opts, log, on_step,
                                                             num_kv_blocks=512))
        _save(model, tokenizer, os.path.join(cfg.output_dir, "gspo", "model"))
        evaluate_stage("SM-GSPO")
    table = format_table(rows)
    if len(rows) > 1:
        table += "\n\n" + format_margins(rows)
    print("\n" + table + "\n", flush=True)
    result = {"command": "python -m train.live " + " ".join(sys.argv[1:]), "minutes": (time.time() - t_start) / 60,
              "cpu_minutes": (time.process_time() - cpu_start) / 60,
              "device": str(device), "threads": torch.get_num_threads(), "rows": rows, "table": table,
              "config": config_dict(cfg)}
    for path in filter(None, (os.path.join(cfg.output_dir, "results.json"), cfg.results)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    with open(os.path.join(cfg.output_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    log(f"done in {result['minutes']:.1f} min ({result['cpu_minutes']:.1f} CPU min: on a shared machine the "
        f"wall time also counts others' work); results in {cfg.output_dir}")
    return result


def _stage_train(cfg: LiveConfig, name: str, body) -> dict:
    metrics = MetricsLogger(os.path.join(cfg.output_dir, name))

    def on_step(step, row):
        metrics.log(step, **{k: v for k, v in row.items() if k != "step"})
        if cfg.progress and (step % 10 == 0 or step == 1):
            log(f"{name} step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                    if k != "step" and isinstance(v, float)))

    try:
        return body(on_step)
    finally:
        metrics.close()
