"""Can SM-GSPO fix a greedy mistake on ONE session it trains on? A check of the optimiser, not a result:
`python -m experiments.gspo_one_session MA_MSFT_CHECKPOINT [LR]` (experiments/results/live/table.md, "Is it the
optimiser?").
Trains on each of the first 3 held-out sessions with greedy task or recipient mistakes in turn (4 copies x 8
trajectories per step, 8 steps, weights restored between sessions) and replays the greedy policy after
each step."""
import sys

import torch

from livemoe.engine.model.loader import load_model, load_tokenizer
from livemoe.train.live.trainer import engine_for
from livemoe.train.live.evaluate import play
from livemoe.train.live.gspo import SMGSPO, GSPOOptions
from livemoe.train.live.judge import score_session
from livemoe.train.live.world import LiveWorldConfig, make_sessions


def greedy(model, tok, session) -> tuple:
    decisions = play(engine_for(model, tok), session, 96)
    return [d.text for d in decisions], score_session(decisions, session).intervals


def mistaken(score) -> bool:
    return score.task is False or score.recipient is False


def main(path: str, lr: float) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tok = load_model(path), load_tokenizer(path)
    held = make_sessions(64, 10_000, LiveWorldConfig(num_intervals=6), "heldout")
    bad = []
    for s in held[:40]:
        texts, scores = greedy(model, tok, s)
        wrong = [i for i, x in enumerate(scores) if mistaken(x)]
        if wrong:
            bad.append((s, wrong, texts))
    print(f"{len(bad)} of 40 sessions with greedy task/recipient mistakes")
    for s, wrong, texts in bad[:3]:
        start = {k: v.clone() for k, v in model.state_dict().items()}
        print("session", s["id"])
        for i in wrong:
            print(f"   interval {i}: gold {s['intervals'][i]['decision']} | greedy {texts[i]}")
        trainer = SMGSPO(model, tok, GSPOOptions(lr=lr, num_generations=8), num_kv_blocks=512)
        for step in range(8):
            row = trainer.step([s] * 4, step)
            texts, scores = greedy(model, tok, s)
            fixed = sum(not mistaken(scores[i]) and scores[i].state for i in wrong)
            broken = sum(i not in wrong and (mistaken(x) or not x.state) for i, x in enumerate(scores))
            print(f"  step {step + 1}: sampled reward {row['turn_reward']:.3f}, task {row['reward/task/mean']:.2f}; "
                  f"greedy fixed {fixed}/{len(wrong)}, newly wrong {broken}")
        for i in wrong:
            print(f"   interval {i} now: {texts[i]}")
        model.load_state_dict(start)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1e-3)
