"""The LiveAssistant seed's training side: the synthetic livestream world, its rule judge, the
trajectory format, MA-MSFT and SM-GSPO (`python -m train.live`, `livemoe live`).

base student -> MA-MSFT (livemoe/train/live/msft.py) -> SM-GSPO (livemoe/train/live/gspo.py) on sessions of the
synthetic livestream world (livemoe/train/live/world.py), each stage evaluated on held-out sessions played
through an engine LiveSession: state, recipient and task accuracy, grounding, decision latency and
decode GFLOPs per interval, in a table like the seed's (printed, and saved as results.json / table.md
with curves PNGs). --stage sft|gspo|all, --data / --eval_data for real trajectories (JSONL, see
livemoe/train/live/data.py), --replay CKPT to watch one held-out session decided interval by interval.

config.py holds the options (LiveConfig), trainer.py the run, __main__.py the command.
"""
