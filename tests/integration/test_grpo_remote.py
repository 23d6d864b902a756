"""`python -m train.grpo --rollout_url URL` against a rollout server on the CPU (its engine core in
its own process): the same per-step losses as the in-process run with the same seeds, with the weights
pushed after each step through a gloo group (--weight_sync distributed) or a checkpoint on disk."""
import pytest
import torch

from fixtures import require_server_extras

require_server_extras()

from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.server import BackgroundServer, ServerConfig  # noqa: E402
from test_grpo import args, varied_reward  # noqa: E402,F401  (the autouse reward fixture, too)
from test_rollout import make_student  # noqa: E402
from livemoe.train.config import ConfigError, parse_config  # noqa: E402
from livemoe.train.grpo.__main__ import main  # noqa: E402
from livemoe.train.grpo.config import GRPOConfig  # noqa: E402
from livemoe.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 3
# the server batches the rollouts differently from the in-process decoder (other fp32 sums): the
# same tokens, log-probs within ~1e-6, so the losses agree to far better than this
LOSS_TOL = 1e-4


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_student(tmp_path_factory.mktemp("student") / "ckpt")


@pytest.fixture(scope="module")
def server(student):
    engine = AsyncLLM(student, engine_core="process", dtype=torch.float32, device="cpu", use_tqdm=False, threads=1,
                      num_kv_blocks=512, block_size=16)
    srv = BackgroundServer(engine, "student", config=ServerConfig(enable_admin_routes=True)).start()
    yield engine, srv
    srv.stop()
    engine.shutdown()


def losses(out) -> list[tuple[float, float]]:
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [(r["loss"], r["reward/mean"]) for r in rows]


_IN_PROCESS: dict = {}


@pytest.fixture
def in_process(student, tmp_path_factory):
    """The in-process run's losses (once per module; function-scoped so test_grpo's reward is in place)."""
    if student not in _IN_PROCESS:
        out = tmp_path_factory.mktemp("local")
        assert main(args(student, out, "--max_steps", str(STEPS))) == 0
        _IN_PROCESS[student] = losses(out)
    return _IN_PROCESS[student]


@pytest.mark.parametrize("sync", ["distributed", "disk", "async"])
def test_remote_rollouts_give_the_in_process_losses(student, server, in_process, tmp_path, sync):
    """async: --async_rollouts --max_staleness 0, the producer thread driving the server (and pushing each version
    it loads): the synchronous run's losses."""
    engine, srv = server
    served = engine.stats()["num_steps"]
    mode = ["--weight_sync", sync] if sync != "async" else ["--async_rollouts", "true", "--max_staleness", "0"]
    assert main(args(student, tmp_path / sync, "--max_steps", str(STEPS), "--rollout_url", srv.url, *mode)) == 0
    remote = losses(tmp_path / sync)
    assert len(remote) == len(in_process) == STEPS
    assert len({loss for loss, _ in in_process}) == STEPS  # the policy moved: each step's loss differs
    print(sync, "max |loss - in-process loss|:", max(abs(a[0] - b[0]) for a, b in zip(remote, in_process)))
    for (loss, reward), (loss0, reward0) in zip(remote, in_process):
        assert reward == reward0  # the same rollouts were drawn
        assert abs(loss - loss0) < LOSS_TOL
    assert engine.stats()["num_steps"] > served  # the server decoded them
    rows = read_metrics(str(tmp_path / sync / "metrics.jsonl"))
    assert max(r["logprob_diff/max"] for r in rows) < 2e-5  # server old_logprobs vs the trainer's: same weights


def test_multi_turn_with_a_rollout_url_is_refused(student, tmp_path):
    with pytest.raises(ConfigError, match="multi_turn"):
        parse_config(GRPOConfig, args(student, tmp_path, "--multi_turn", "true", "--rollout_url", "http://x:1"))
    with pytest.raises(ConfigError, match="weight_sync"):
        parse_config(GRPOConfig, args(student, tmp_path, "--weight_sync", "nfs"))
    with pytest.raises(ConfigError, match="partial_rollouts"):
        parse_config(GRPOConfig, args(student, tmp_path, "--async_rollouts", "true", "--partial_rollouts", "true",
                                      "--rollout_url", "http://x:1"))
