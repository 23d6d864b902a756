"""`make demo` until the trainers land: make a tiny random Qwen3-MoE checkpoint with transformers, load it
with the engine, check the logits against transformers, and print its FLOPs accounting."""
import json
import os
import sys

import torch


def main(out_dir: str = "outputs/demo-checkpoint") -> int:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import engine
    from engine import flops

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(out_dir)
    model = engine.load_model(out_dir, device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"checkpoint: {os.path.abspath(out_dir)}")
    print(f"max |logits - transformers| = {diff:.2e}")
    print(json.dumps(flops.report(model.config, context_len=32, prompt_len=32, tokens=64), indent=2))
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
