"""GRPO rewards (LiveThinking seed, section 4.2): r = w_c * correct + w_h * helpful + w_l * length.

Length reward, exactly the seed's, with d measured as a FRACTION OF L_ref:
    L_upper = lambda_upper * L_ref,   L_lower = lambda_lower * L_ref
    d = (L_lower - L_policy) / L_ref  if L_policy < L_lower
        (L_policy - L_upper) / L_ref  if L_policy > L_upper
        0                              otherwise
    r_length = max(0, 1 - d / epsilon)
so epsilon = 0.1 means "the reward reaches 0 at 10% of the reference length outside the interval"
(with the seed's defaults, L_ref = 300 gives full reward in [120, 150] tokens and 0 below 90 or above
180). Measuring d in tokens instead would make epsilon = 0.1 a cliff a tenth of a token wide.

Correctness and helpfulness come from any judge of livemoe.train.judges (Verdict.correct / .helpful). For
MuSiQue records (meta.kind == "musique") the seed uses EM as the correctness reward and leaves
helpfulness out: the w_h term is dropped for them (not renormalised: advantages are normalised per
group, so only the ratio w_c : w_l matters).

User reward functions join by dotted import path, `module:attr[=weight]` (weight default 1), each
called as fn(record, completion, info) -> float with info = {"policy_len", "ref_len", "verdict"}; its
weighted value is added to r and logged under its attr name.
"""
import math
from dataclasses import dataclass, field

from livemoe.train.imports import import_object, split_path


class RewardError(ValueError):
    """A bad reward option or a reward function that returned something unusable."""


def length_reward(policy_len, ref_len, lambda_upper: float = 0.5, lambda_lower: float = 0.4,
                  epsilon: float = 0.1) -> float:
    """The seed's length reward in [0, 1] (d as a fraction of ref_len; see the module docstring)."""
    if not ref_len > 0:
        raise RewardError(f"length_reward: ref_len must be > 0, got {ref_len!r}")
    if not policy_len >= 0:
        raise RewardError(f"length_reward: policy_len must be >= 0, got {policy_len!r}")
    if not 0 <= lambda_lower <= lambda_upper:
        raise RewardError(f"length_reward: need 0 <= lambda_lower <= lambda_upper, got {lambda_lower}, {lambda_upper}")
    if not epsilon > 0:
        raise RewardError(f"length_reward: epsilon must be > 0, got {epsilon!r}")
    lower, upper = lambda_lower * ref_len, lambda_upper * ref_len
    if policy_len < lower:
        d = (lower - policy_len) / ref_len
    elif policy_len > upper:
        d = (policy_len - upper) / ref_len
    else:
        d = 0.0
    return max(0.0, 1.0 - d / epsilon)


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    w_correct: float = 0.4
    w_helpful: float = 0.3
    w_length: float = 0.3
    lambda_upper: float = 0.5
    lambda_lower: float = 0.4
    length_epsilon: float = 0.1
    reward_fns: str = ""  # comma-separated module:attr[=weight]

    def __post_init__(self):
        for name in ("w_correct", "w_helpful", "w_length"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise RewardError(f"--{name} must be a finite number >= 0, got {v!r}")
        if not 0 <= self.lambda_lower <= self.lambda_upper:
            raise RewardError(f"need 0 <= --lambda_lower <= --lambda_upper, got {self.lambda_lower}, {self.lambda_upper}")
        if not self.length_epsilon > 0:
            raise RewardError(f"--length_epsilon must be > 0, got {self.length_epsilon}")


@dataclass(slots=True)
class RewardResult:
    reward: float
    components: dict = field(default_factory=dict)  # correct, helpful (absent for MuSiQue), length, user fns
    verdict: object = None


def load_reward_fns(spec: str) -> list:
    """'a.b:fn=0.5,c.d:g' -> [("fn", callable, 0.5), ("g", callable, 1.0)]."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        path, _, w = item.partition("=")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            raise RewardError(f"reward function {item!r}: weight {w!r} is not a number") from None
        try:
            fn = import_object(path)
        except ValueError as e:
            raise RewardError(f"reward function {item!r}: {e}") from None
        attr = split_path(path)[1]
        if not callable(fn):
            raise RewardError(f"reward function {path!r} is not callable")
        if attr in ("correct", "helpful", "length"):
            raise RewardError(f"reward function {path!r}: name {attr!r} clashes with a built-in component")
        out.append((attr, fn, weight))
    return out


class CompositeReward:
    """`reward(records, completions, policy_lens, ref_lens) -> list[RewardResult]` (one judge batch)."""

    def __init__(self, judge, config: RewardConfig | None = None):
        self.judge, self.config = judge, config or RewardConfig()
        self.user_fns = load_reward_fns(self.config.reward_fns)

    def __call__(self, records: list, completions: list, policy_lens: list, ref_lens: list) -> list:
        if not len(records) == len(completions) == len(policy_lens) == len(ref_lens):
            raise RewardError("reward: records, completions, policy_lens and ref_lens differ in length")
        c = self.config
        verdicts = self.judge.judge_batch(records, completions)
        out = []
        for rec, text, n, ref, v in zip(records, completions, policy_lens, ref_lens, verdicts):
            comp = {"correct": float(v.correct)}
            r = c.w_correct * comp["correct"]
            if rec.get("meta", {}).get("kind") != "musique":  # MuSiQue: EM only, no helpfulness (seed)
                comp["helpful"] = float(v.helpful)
                r += c.w_helpful * comp["helpful"]
            comp["length"] = length_reward(n, ref, c.lambda_upper, c.lambda_lower, c.length_epsilon)
            r += c.w_length * comp["length"]
            for name, fn, w in self.user_fns:
                value = fn(rec, text, {"policy_len": n, "ref_len": ref, "verdict": v})
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise RewardError(f"reward function {name} returned {value!r}, not a number") from None
                if not math.isfinite(value):
                    raise RewardError(f"reward function {name} returned {value}")
                comp[name] = value
                r += w * value
            out.append(RewardResult(r, comp, v))
        return out
