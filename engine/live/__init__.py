"""Live sessions (the LiveAssistant seed): long-lived requests that decide OBS / MEM / ANS each interval."""
from engine.live.decision import TASKS, Decision, DecisionFormatError, DecisionMetrics, parse_decision

__all__ = ["TASKS", "Decision", "DecisionFormatError", "DecisionMetrics", "parse_decision"]
