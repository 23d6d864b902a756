"""Held-out evaluation in the shape of the seed's Table 3: correctness, helpfulness (or EM / F1 on MuSiQue),
tokens per response (TPR) and decode cost per response (2 x active parameters x tokens, livemoe.engine.model.flops).

`evaluate(model, tokenizer, records, judge)` generates with the engine decoder over the very module
(no copy) and releases the decoder's KV cache afterwards, so training can follow in the same process.
"""
import json
import os

from livemoe.train.data import build_prompt


def evaluate(model, tokenizer, records: list, judge, max_new_tokens: int = 256, temperature: float = 0.0,
             seed: int = 0, progress: bool = True, label: str = "model", samples: int = 1) -> dict:
    """One row of the table. temperature 0: the greedy response per record; else `samples` responses
    sampled per record, each request with its own seed (one seed shared by every request would draw
    the same noise for all of them: correlated samples, not an estimate), metrics averaged over all."""
    from livemoe.engine.llm import LLM
    from livemoe.engine.model.flops import decode_flops, param_counts
    from livemoe.engine.sampling.params import SamplingParams

    if temperature == 0 and samples != 1:
        raise ValueError(f"evaluate: samples={samples} needs temperature > 0 (greedy responses are identical)")
    was_training = model.training
    model.eval()
    llm = LLM.from_model(model, tokenizer, seed=seed, use_tqdm=progress)
    try:
        # request r's samples get seeds base + r * samples + j: distinct for every response
        base = seed * 1_000_003
        params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, n=samples,
                                 seed=base + r * samples) for r in range(len(records))]
        outs = llm.generate([build_prompt(r, tokenizer) for r in records], params)
    finally:
        if not llm.has_unfinished_requests():
            llm.release_kv_cache()
    model.train(was_training)
    prompts = len(records)
    records = [r for r in records for _ in range(samples)]
    completions = [c for o in outs for c in o.outputs]
    texts = [c.text for c in completions]
    lengths = [len(c.token_ids) for c in completions]
    counts = param_counts(model.config)
    flops = [decode_flops(model.config, n) for n in lengths]
    result = summarize(records, texts, lengths, judge, label)
    result.update(params_total=counts["total"], params_active=counts["active"],
                  decode_gflops=sum(flops) / max(1, len(flops)) / 1e9,
                  truncated=sum(c.finish_reason == "length" for c in completions) / max(1, len(completions)),
                  prompts=prompts, samples_per_prompt=samples, temperature=temperature)
    return result


def summarize(records: list, texts: list, lengths: list, judge, label: str) -> dict:
    """Judge `texts` against `records`; rates in percent as the seed reports them."""
    verdicts = judge.judge_batch(records, texts)
    n = max(1, len(records))
    out = {"label": label, "n": len(records), "correct": 100 * sum(v.correct for v in verdicts) / n,
           "helpful": 100 * sum(v.helpful for v in verdicts) / n, "tpr": sum(lengths) / n,
           "unparseable": sum(v.unparseable for v in verdicts)}
    if any("em" in v.scores for v in verdicts):
        out["em"] = 100 * sum(v.scores.get("em", 0.0) for v in verdicts) / n
        out["f1"] = 100 * sum(v.scores.get("f1", 0.0) for v in verdicts) / n
    out["samples"] = [{"id": r.get("id"), "question": r["question"], "completion": t, "correct": v.correct,
                       "helpful": v.helpful, "reason": v.reason} for r, t, v in zip(records, texts, verdicts)]
    return out


def format_table(rows: list) -> str:
    """Markdown table shaped like the seed's Table 3 (parameters in millions, decode cost in GFLOPs)."""
    musique = any("em" in r for r in rows)
    quality = ["EM", "F1"] if musique else ["Correct.", "Helpful."]
    head = ["Model", "Total (M)", "Active (M)", *quality, "TPR", "D. GFLOPs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        q = [r.get("em"), r.get("f1")] if musique else [r["correct"], r["helpful"]]
        cells = [r["label"], _m(r.get("params_total")), _m(r.get("params_active")),
                 *[f"{x:.1f}" if x is not None else "-" for x in q], f"{r['tpr']:.0f}",
                 f"{r['decode_gflops']:.4f}" if r.get("decode_gflops") is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _m(n):
    return f"{n / 1e6:.2f}" if n else "-"


def write_eval(output_dir: str, rows: list) -> str:
    """eval_table.md (the table) and eval.json (every row with its judged samples)."""
    os.makedirs(output_dir, exist_ok=True)
    table = format_table(rows)
    with open(os.path.join(output_dir, "eval_table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(output_dir, "eval.json"), "w") as f:
        json.dump(rows, f, indent=1, ensure_ascii=False)
    return table
