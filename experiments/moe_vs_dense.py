"""The seed's Figure 5: RFT held-out loss curves (`livemoe.train.rft --eval_every`) of the MoE student against dense
students of equal ACTIVE and of equal TOTAL parameters (counted by livemoe.engine.model.flops.param_counts).

All three are random-initialised with the base student's tokenizer and, but for the MLP, its shape (layers,
width, heads): pre-training each the way the committed student was made takes 40 minutes apiece, beyond
this experiment's budget, and a pre-trained MoE against random dense models would measure the pre-training,
not the architecture. From random weights the teacher's answers are the only training, the same for all.
"""
import json
import os

from experiments.common import TINY_RFT, ExperimentArgs, logged, plot_panels, run_rft, write_report

NAME = "moe_vs_dense"
TITLE = "Figure 5: RFT held-out loss of the MoE student vs dense students of equal active / total parameters"
USES_START = False
# 1,024 rooms, RFT's selection, 2 epochs of batch 8 (~245 steps) per model, the held-out loss every 20
# steps: three models in ~20 minutes of a 2-core CPU shared with other jobs (load average ~10). Greedy,
# short held-out rows (a random-init model writes to the token limit; a side note to the loss curves).
FULL = ["--train_rooms", "1024", "--epochs", "2", "--eval_every", "20", "--eval_temperature", "0", "--eval_samples", "1",
        "--eval_max_new_tokens", "64"]
TINY = [*TINY_RFT, "--eval_every", "1"]
# the config.json keys that make a Qwen3-MoE: a dense student has none of them
MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")
COLUMNS = ["Model", "Total params", "Active params", "MLP", "Eval loss at step 0", "Final eval loss",
           "Lowest eval loss", "Correct.", "Helpful.", "TPR"]
DECIMALS = {"Eval loss at step 0": 3, "Final eval loss": 3, "Lowest eval loss": 3}


def counts(raw: dict) -> dict:
    from livemoe.engine.model.config import ModelConfig
    from livemoe.engine.model.flops import param_counts

    return param_counts(ModelConfig.from_dict(raw, source="moe_vs_dense"))


def dense_config(moe: dict, target: int, which: str) -> dict:
    """The MoE config without its experts, with the dense intermediate_size whose `which` count ("active"
    or "total") comes closest to `target`."""
    base = {k: v for k, v in moe.items() if k not in MOE_KEYS}
    base.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    best = min(range(1, 16 * moe["hidden_size"] + 1),
               key=lambda i: abs(counts({**base, "intermediate_size": i})[which] - target))
    return {**base, "intermediate_size": best}


def write_student(path: str, raw: dict, tokenizer_from: str, seed: int) -> str:
    """A random-init checkpoint of `raw` (transformers' own init) with `tokenizer_from`'s tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path


def students(args: ExperimentArgs) -> dict:
    """name -> (checkpoint dir, config dict): the MoE student and its two dense counterparts."""
    with open(os.path.join(args.model, "config.json")) as f:
        moe = json.load(f)
    if not num_experts(moe):
        raise ValueError(f"--model {args.model}: moe_vs_dense needs a Qwen3-MoE student (its config has no experts)")
    c = counts(moe)
    configs = {"MoE": moe, "dense, equal active": dense_config(moe, c["active"], "active"),
               "dense, equal total": dense_config(moe, c["total"], "total")}
    root = os.path.join(args.work_dir, "students")
    return {name: (write_student(os.path.join(root, slug(name)), raw, args.model, args.seed), raw)
            for name, raw in configs.items()}


def slug(name: str) -> str:
    return name.replace(",", "").replace(" ", "_")


def run(args: ExperimentArgs) -> str:
    rows, curves, arms = [], {}, []
    for name, (path, raw) in students(args).items():
        # no rehearsal: the models start from random weights, with no pre-training to keep (and the figure was made without)
        arm = run_rft(args, slug(name), TINY if args.tiny else FULL, ["--rehearsal", 0], model=path)
        arms.append(arm)
        curve = logged(arm, "eval_loss")
        curves[name] = ([s for s, _ in curve], [v for _, v in curve], None)
        after = arm.result["rows"][-1]
        c = counts(raw)
        rows.append([name, c["total"], c["active"], mlp_shape(raw), curve[0][1], curve[-1][1], min(v for _, v in curve), after["correct"], after["helpful"], after["tpr"]])
    png = plot_panels(f"{args.output_dir}/{NAME}.png", "RFT held-out loss (random init, same tokenizer and data)",
                      "optimizer step", [("held-out SFT loss (log scale)", curves)], log_y=True)
    after = arms[0].result["rows"][-1]
    notes = f"""Seed (Qwen3-30B-A3B, 3B active): the MoE's eval loss approaches a ~7.5B dense model's and is far below
the small dense models'. Here: the MoE student's shape (`{args.model}`) and two dense Qwen3 models with the same
layers, width, heads and tokenizer, whose MLP width makes their parameter count equal the MoE's active (resp.
total) count as livemoe.engine.model.flops counts them (embedding and output head included; a dense model's active = total).
All three are random-initialised (transformers' init, seed {args.seed}): pre-training each as the committed
student was made takes 40 minutes apiece, and a pre-trained MoE against random dense models would compare
pre-training, not architectures. Each then runs the same RFT (same teacher samples, selection, steps, lr, λ_aux
0.01 for the MoE). Eval loss: the SFT loss on the judge-selected teacher answers to the held-out rooms. Held-out
rows after RFT: {after['prompts']} rooms, {after['samples_per_prompt']} response each at τ {after['temperature']}
(greedy and short: a side note to the loss curves)."""
    return write_report(args, TITLE, COLUMNS, rows, notes, arms, png, DECIMALS)


def num_experts(raw: dict) -> int:
    return raw.get("num_experts") or raw.get("num_local_experts") or 0


def mlp_shape(raw: dict) -> str:
    if num_experts(raw):
        return f"{num_experts(raw)} experts of {raw['moe_intermediate_size']}, top-{raw['num_experts_per_tok']}"
    return f"dense {raw['intermediate_size']}"
