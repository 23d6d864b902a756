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


def test_a_bad_weight_sync_is_refused(student, tmp_path):
    with pytest.raises(ConfigError, match="weight_sync"):
        parse_config(GRPOConfig, args(student, tmp_path, "--weight_sync", "nfs"))


def _remote_interrupted(ro, new_model, version: int, prompts: list, tries: int = 5) -> list:
    """ro.generate(prompts) with `new_model` pushed (labelled `version`, in_flight interrupt) at the first poll while
    the requests are in flight; again until some completion was cut mid-way (the push races the decoding)."""
    for _ in range(tries):
        ro.weights_updated(ro.start_model, version - 1)  # back to the old weights, labelled
        pushed = []

        def hook():
            if not pushed:
                pushed.append(1)
                ro.weights_updated(new_model, version, "interrupt")

        ro.between_steps = hook
        got = [c for g in ro.generate(prompts, step=0) for c in g]
        ro.between_steps = None
        if any(0 < c.versions.count(version - 1) < len(c.token_ids) for c in got):
            return got
    raise AssertionError(f"no completion was interrupted mid-way in {tries} tries")


@pytest.mark.parametrize("same_weights", [True, False])
def test_an_interrupted_remote_rollout_resumes_with_its_versions(student, server, same_weights):
    """Partial rollouts against a server: a push with in_flight "interrupt" and a weight_version label preempts the
    requests in flight, which resume on the new weights; each token comes back with the label of the weights that
    drew it (return_weight_versions). With the same weights the tokens are exactly the uninterrupted run's (the
    seeded draws go on), the log-probs to 1e-5 (a prefill recomputes what decode steps computed); with other
    weights the tokens before the interruption are the old run's, and every token's behaviour log-prob is the
    trainer's recomputation with the weights of its version (fp32, 2e-5: the server batches differently)."""
    import copy

    from livemoe.engine.model.loader import load_model, load_tokenizer
    from livemoe.train.remote_rollout import RemoteRollouts
    from livemoe.train.rollout import collate
    from test_rollout import PROMPTS, trainer_logprobs

    _, srv = server
    model, tok = load_model(student, dtype=torch.float32), load_tokenizer(student)
    new_model = copy.deepcopy(model)
    if not same_weights:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in new_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    ro = RemoteRollouts([srv.url], tok, model, num_generations=3, max_new_tokens=48, temperature=1.0, seed=5)
    try:
        ro.start_model = model
        ro.return_weight_versions = True
        ro.weights_updated(model, 0)
        plain = [c for g_ in ro.generate(PROMPTS, step=0) for c in g_]
        assert all(c.versions == [0] * len(c.token_ids) for c in plain)
        got = _remote_interrupted(ro, new_model, 1, PROMPTS)
    finally:
        ro.close()
    batch = collate(got, [0.0] * len(got), pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp = {0: trainer_logprobs(model, batch, 1.0), 1: trainer_logprobs(new_model, batch, 1.0)}
    for i, (a, b) in enumerate(zip(plain, got)):
        k = b.versions.count(0)
        assert b.versions == [0] * k + [1] * (len(b.token_ids) - k)
        if same_weights:
            assert b.token_ids == a.token_ids
            assert b.old_logprobs == pytest.approx(a.old_logprobs, abs=1e-5)
        else:
            assert b.token_ids[:k] == a.token_ids[:k]
            p = len(b.prompt_ids)
            for t, v in enumerate(b.versions):
                assert abs(lp[v][i, p - 1 + t] - b.old_logprobs[t]) < 2e-5, (i, t, v)


@pytest.mark.parametrize("multi_turn", [False, True])
def test_remote_partial_rollouts_train_within_the_staleness_bound(student, server, tmp_path, multi_turn):
    """--partial_rollouts --rollout_url: the producer pushes each version (labelled) as soon as the trainer publishes
    it, interrupting the server's requests in flight; the servers' labels are the tokens' versions, and whatever the
    timing every token trained at step t is from a version in [t - S, t]."""
    _, srv = server
    extra = []
    if multi_turn:
        write_jsonl(str(tmp_path / "mt.jsonl"), multi_turn_records())
        extra = ["--data", str(tmp_path / "mt.jsonl"), "--multi_turn", "true"]
    out = tmp_path / "partial"
    assert main(args(student, out, "--max_steps", "4", "--async_rollouts", "true", "--max_staleness", "1",
                     "--partial_rollouts", "true", "--rollout_url", srv.url, *extra)) == 0
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for t, r in enumerate(rows):
        assert 0 <= r["async/staleness"] <= 1 and t - r["async/version"] == r["async/staleness"]
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness"] and 0 <= r["async/interrupted_frac"] <= 1


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
@pytest.mark.parametrize("sync", ["distributed", "disk", "async"])
def test_two_trainer_ranks_with_two_rollout_replicas_equal_one_process(student, two_replicas, tmp_path, sync):
    """torchrun 2 ranks (FSDP2, gloo) against one server of 2 engine cores: each rank sends its prompts, rank 0
    pushes the gathered weights once to both replicas (async: --async_rollouts --max_staleness 0, each rank's
    producer thread sending its prompts, rank 0's pushing each version, the others waiting for it). Against one in-process process: rewards and lengths equal
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
    mode = ["--async_rollouts", "true", "--max_staleness", "0"] if sync == "async" else ["--weight_sync", sync]
    res = torchrun_grpo(2, args(student, two, *flags, "--rollout_url", srv.url, *mode))
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


@pytest.mark.slow
def test_two_trainer_ranks_one_step_stale_against_two_rollout_replicas(student, two_replicas, tmp_path):
    """--async_rollouts --max_staleness 1 under torchrun against 2 replicas: step 2 is rolled out with version 0
    (no push), step 3 with version 1, which rank 0 pushes while every rank's producer waits at the barrier before
    sending its prompts. Against one process with in-process S = 1 rollouts: the same versions, rewards and lengths
    (the same tokens, so every rank decoded with the right version) and the losses of the test above."""
    from test_parallel_grpo import REWARD, torchrun_grpo

    engine, srv = two_replicas
    flags = [*REWARD, "--device", "cpu", "--rollout_is", "none", "--max_steps", "3", "--async_rollouts", "true",
             "--max_staleness", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(args(student, one, *flags)) == 0
    res = torchrun_grpo(2, args(student, two, *flags, "--rollout_url", srv.url))
    assert res.returncode == 0, res.stderr[-3000:]
    ref_rows, rows = read_metrics(str(one / "metrics.jsonl")), read_metrics(str(two / "metrics.jsonl"))
    assert [r["async/version"] for r in rows] == [r["async/version"] for r in ref_rows] == [0, 0, 1]
    for key in ("reward/mean", "tpr/mean"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    for a, b in zip(rows, ref_rows):
        assert abs(a["loss"] - b["loss"]) < LOSS_TOL
        for key in ("grad_norm", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), key


def partial_remote_rank(argv: list) -> dict:
    """One trainer rank of --partial_rollouts --rollout_url under torchrun (spawn_ranks): trains, and returns the
    completions it trained on (per step) and, on rank 0, each version's weights. The push must land while requests
    are in flight, which on this tiny model would be luck (an update outlasts a batch's decoding), so the timing is
    arranged: the requests of batch v wait until the trainer has version v, and the trainer publishes it once they are
    sent; rank 0's producer then pushes it within a poll (POLL_S) while both ranks' requests decode."""
    import threading

    from livemoe.train.grpo.trainer import GRPOTrainer

    trainer = GRPOTrainer(parse_config(GRPOConfig, argv))
    seen, weights, cond = [], {}, threading.Condition()
    state = {"sent": 0, "updated": 0, "base": None}  # requests sent (of the batches); the trainer's newest version
    ro, make_batch, start_async = trainer.rollouts, trainer.make_batch, trainer.start_async
    one = ro._one
    per_batch = len(trainer.dist.local_share(list(range(trainer.cfg.batch_size))))  # one request per prompt

    def one_request(*a, **kw):
        with cond:
            if state["base"] is not None:  # not the reference lengths' greedy requests
                batch = (state["sent"] - state["base"]) // per_batch
                assert cond.wait_for(lambda: state["updated"] >= batch, timeout=120)
            state["sent"] += 1
            cond.notify_all()
        return one(*a, **kw)

    def recording_make_batch(out):
        seen.append([(c.prompt_ids, c.token_ids, c.old_logprobs, c.versions)
                     for g in out["sampled"] for c in g["comps"] or ()])
        return make_batch(out)

    def recording_start_async():
        with cond:
            state["base"] = state["sent"]
        producer = start_async()
        publish = producer.publish
        weights[trainer.step] = {n: p.detach().clone() for n, p in trainer.infer.named_parameters()}

        def late_publish(version, model):
            weights[version] = {n: p.detach().clone() for n, p in model.named_parameters()}
            with cond:
                state["updated"] = version
                cond.notify_all()
                if version < trainer.total_steps:  # batch `version` is rolled out now: publish once it is sent
                    assert cond.wait_for(lambda: state["sent"] - state["base"] > version * per_batch, timeout=120)
            publish(version, model)

        producer.publish = late_publish
        return producer

    ro._one, trainer.make_batch, trainer.start_async = one_request, recording_make_batch, recording_start_async
    trainer.train()
    return {"seen": seen, "weights": weights if trainer.dist.is_main else None}


@pytest.mark.slow
def test_partial_rollouts_of_two_trainer_ranks_against_two_rollout_replicas(student, two_replicas, tmp_path):
    """--partial_rollouts --rollout_url under torchrun (2 gloo ranks, a server of 2 engine cores): rank 0 pushes each
    version as soon as its trainer publishes it, with in_flight "interrupt", and the requests of both ranks in flight
    resume on the new weights; the ranks meet once per batch. Every token of step t's batch, on either rank, is from a
    version in [t - 1, t], the versions of a completion never decrease, some completions of each rank were cut mid-way,
    and each token's behaviour log-prob is the trainer's recomputation with its version's weights (fp32, 2e-5: the
    server batches differently)."""
    from spawn_ranks import spawn_ranks
    from livemoe.engine.model.loader import load_model, load_tokenizer
    from livemoe.train.rollout import Completion, collate
    from test_rollout import trainer_logprobs

    engine, srv = two_replicas
    steps = 3
    out = tmp_path / "partial"
    argv = args(student, out, "--reward_fns", "test_precision:varied", "--device", "cpu", "--max_steps", str(steps),
                "--max_new_tokens", "64", "--async_rollouts", "true", "--max_staleness", "1", "--partial_rollouts",
                "true", "--rollout_url", srv.url, "--temperature", "1.0")
    ranks = spawn_ranks(partial_remote_rank, 2, argv, timeout=400)
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    model = load_model(student, dtype=torch.float32)
    pad_id = load_tokenizer(student).pad_token_id
    weights = ranks[0]["weights"]
    assert sorted(weights) == list(range(steps + 1))
    for rank, r in enumerate(ranks):
        assert len(r["seen"]) == steps
        cut = 0
        for t, comps in enumerate(r["seen"]):
            assert len(comps) == 4  # this rank's prompt, K = 4
            for _, ids, _, versions in comps:
                assert len(versions) == len(ids) > 0 and versions == sorted(versions)
                assert max(t - 1, 0) <= versions[0] and versions[-1] <= t, (rank, t, versions)
                cut += 0 < versions.count(versions[0]) < len(ids)
            batch = collate([Completion(p, ids, lps, "", "length") for p, ids, lps, _ in comps], [0.0] * len(comps),
                            pad_id=pad_id)
            lp = {}
            for v in sorted({v for *_, versions in comps for v in versions}):
                assert weights[v].keys() == dict(model.named_parameters()).keys()
                model.load_state_dict(weights[v], strict=False)
                with torch.no_grad():
                    lp[v] = trainer_logprobs(model, batch, 1.0)
            for i, (p, _, lps, versions) in enumerate(comps):
                for k, v in enumerate(versions):
                    assert abs(lp[v][i, len(p) - 1 + k] - lps[k]) < 2e-5, (rank, t, i, k, v)
        print(f"rank {rank}: {cut} completions cut mid-way")
        assert cut > 0, f"rank {rank}: no completion was interrupted mid-way"
    assert min(engine.served_per_replica()) > 0
