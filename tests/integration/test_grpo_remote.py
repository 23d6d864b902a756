"""`python -m train.grpo --rollout_url URL` against a rollout server on the CPU (its engine core in
its own process): the same per-step losses as the in-process run with the same seeds, with the weights
pushed after each step through a gloo group (--weight_sync distributed) or a checkpoint on disk; --multi_turn
against the server gives the in-process trajectories; 2 torchrun ranks against a server of 2 replicas give the
one-process in-process run's losses."""
import pytest
import torch

from fixtures import require_server_extras

require_server_extras()

from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.server import BackgroundServer, ServerConfig  # noqa: E402
from test_grpo import args, multi_turn_records, varied_reward  # noqa: E402,F401  (the autouse reward fixture, too)
from test_rollout import make_student  # noqa: E402
from livemoe.train.config import ConfigError, parse_config  # noqa: E402
from livemoe.train.data import write_jsonl  # noqa: E402
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


def test_bad_weight_sync_and_partial_rollouts_with_a_rollout_url_are_refused(student, tmp_path):
    with pytest.raises(ConfigError, match="weight_sync"):
        parse_config(GRPOConfig, args(student, tmp_path, "--weight_sync", "nfs"))
    with pytest.raises(ConfigError, match="partial_rollouts"):
        parse_config(GRPOConfig, args(student, tmp_path, "--async_rollouts", "true", "--partial_rollouts", "true",
                                      "--rollout_url", "http://x:1"))


def test_multi_turn_with_a_rollout_url_gives_the_in_process_run(student, server, tmp_path):
    """One request per turn, seeded as the in-process decoder seeds each (conversation, sample, turn)."""
    data = tmp_path / "mt.jsonl"
    write_jsonl(str(data), multi_turn_records())
    flags = ["--data", str(data), "--multi_turn", "true", "--turn_weight", "0.5"]
    assert main(args(student, tmp_path / "local", *flags)) == 0
    assert main(args(student, tmp_path / "remote", *flags, "--rollout_url", server[1].url)) == 0
    local, remote = (read_metrics(str(tmp_path / d / "metrics.jsonl")) for d in ("local", "remote"))
    assert len(local) == len(remote) == 2
    for a, b in zip(remote, local):
        for key in ("reward/mean", "tpr/mean", "tpr/max"):  # the same trajectories were drawn
            assert a[key] == b[key], key
        assert abs(a["loss"] - b["loss"]) < LOSS_TOL
    assert local[0]["tpr/max"] > 10  # more than one turn's tokens


_ONE_PROCESS: dict = {}


@pytest.fixture(scope="module")
def two_replicas(student):
    engine = AsyncLLM(student, engine_core="process", data_parallel_size=2, dtype=torch.float32, device="cpu",
                      use_tqdm=False, threads=1, num_kv_blocks=512, block_size=16)
    srv = BackgroundServer(engine, "student", config=ServerConfig(enable_admin_routes=True)).start()
    yield engine, srv
    srv.stop()
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["distributed", "disk"])
def test_two_trainer_ranks_with_two_rollout_replicas_equal_one_process(student, two_replicas, tmp_path, sync):
    """torchrun 2 ranks (FSDP2, gloo) against one server of 2 engine cores: each rank sends its prompts, rank 0
    pushes the gathered weights once to both replicas. Against one in-process process: rewards and lengths equal
    (the same tokens are drawn), losses within LOSS_TOL (the server's batching and the ranks' reduction order
    differ from one process only in fp32 rounding) and grad norms and KL within rtol 1e-4 (2 steps: the tests of
    2 ranks in-process see 1e-5 relative; the server's log-probs add ~1e-6 absolute)."""
    from test_parallel_grpo import REWARD, torchrun_grpo

    engine, srv = two_replicas
    flags = [*REWARD, "--device", "cpu", "--rollout_is", "none"]
    two = tmp_path / "two"
    if "one" not in _ONE_PROCESS:  # the reference, once for both weight syncs
        one = tmp_path / "one"
        assert main(args(student, one, *flags)) == 0
        _ONE_PROCESS["one"] = read_metrics(str(one / "metrics.jsonl"))
    res = torchrun_grpo(2, args(student, two, *flags, "--rollout_url", srv.url, "--weight_sync", sync))
    assert res.returncode == 0, res.stderr[-3000:]
    ref_rows, rows = _ONE_PROCESS["one"], read_metrics(str(two / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2]
    for key in ("reward/mean", "tpr/mean"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    print(sync, {k: max(abs(a[k] - b[k]) for a, b in zip(rows, ref_rows)) for k in ("loss", "grad_norm", "kl")})
    for a, b in zip(rows, ref_rows):
        assert abs(a["loss"] - b["loss"]) < LOSS_TOL
        for key in ("grad_norm", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), key
    assert min(engine.served_per_replica()) > 0  # both replicas decoded
