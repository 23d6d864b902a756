"""The embedded default: a seeded world of live-stream commerce rooms, its scripted teacher, its corpus."""
from livemoe.train.synthetic.teacher import ScriptedTeacher, TeacherRates
from livemoe.train.synthetic.world import WorldConfig, make_rooms

__all__ = ["ScriptedTeacher", "TeacherRates", "WorldConfig", "make_rooms"]
