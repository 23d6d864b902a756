"""Live sessions (the LiveAssistant seed): long-lived requests that decide OBS / MEM / ANS each interval."""
from livemoe.engine.errors import DecisionFormatError
from livemoe.engine.live.decision import KINDS, TASKS, Decision, DecisionMetrics, parse_decision
from livemoe.engine.live.session import LiveSession, step_sessions

__all__ = ["KINDS", "TASKS", "Decision", "DecisionFormatError", "DecisionMetrics", "LiveSession", "parse_decision",
           "step_sessions"]
