"""fp32 master weights for bf16 compute on one device (livemoe.train.precision): at the seed's lr 2.5e-6 every fp32 master
weight ~N(0, 0.02) moves in 10 AdamW steps while bf16 weights updated in place mostly do not (the defect the
masters fix); gradients accumulate in fp32; livemoe.train.grpo with --bf16 true trains and checkpoints the fp32 masters,
and a resumed run continues from them exactly."""
import pytest
import torch

from livemoe.train.precision import MasterWeights

LR, STEPS = 2.5e-6, 10


def _model():
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64, bias=False)
    torch.nn.init.normal_(m.weight, 0.0, 0.02)
    return m


def _train(model, opt, after_step=None):
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(8, 64, generator=g).to(model.weight.dtype)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step:
            after_step()


def test_fp32_masters_move_every_weight_at_lr_2_5e_6_where_bf16_weights_do_not():
    start = _model().weight.detach().clone()
    plain = _model().to(torch.bfloat16)  # the defect: weights and AdamW states in bf16
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.0))
    moved_bf16 = (plain.weight.float() != start.bfloat16().float()).float().mean().item()

    model = _model()
    master = MasterWeights(model)
    assert model.weight.dtype == torch.bfloat16 and master.parameters()[0].dtype == torch.float32
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.0)
    _train(model, opt, master.copy_to_model)
    fp32 = master.parameters()[0].detach()
    assert (fp32 != start).all()  # every master weight moved
    assert opt.state[master.parameters()[0]]["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(model.weight, fp32.bfloat16())  # the module computes with the masters, rounded
    assert moved_bf16 < 0.25, moved_bf16  # in bf16 most weights never move (the issue saw ~4%)


def test_gradients_accumulate_in_fp32():
    model, ref = _model(), _model().bfloat16()
    master = MasterWeights(model)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 64, generator=g).bfloat16() for _ in range(4)]
    grads = []
    for x in xs:
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        grads.append(ref.weight.grad.clone())
        ref.weight.grad = None
    assert model.weight.grad is None  # each bf16 gradient is dropped once summed
    want = sum(x.float() for x in grads)  # each micro-batch's bf16 gradient, summed in fp32
    assert torch.equal(master.parameters()[0].grad, want)
    assert not torch.equal(sum(grads).float(), want)  # summing in bf16 would round
    with master.fp32_model() as m:
        assert m.weight.dtype == torch.float32 and m.weight.data_ptr() == master.parameters()[0].data_ptr()
    assert model.weight.dtype == torch.bfloat16


def test_masters_need_an_fp32_model():
    with pytest.raises(ValueError, match="fp32 master weights are taken from an fp32 model; parameter 'weight' is "
                                         "torch.bfloat16"):
        MasterWeights(_model().bfloat16())


def test_grpo_bf16_trains_and_checkpoints_fp32_masters(tmp_path):
    from test_grpo import args, state  # noqa: F401  (the module's helpers)
    from test_rollout import make_student
    from livemoe.train.config import parse_config
    from livemoe.train.grpo.config import GRPOConfig
    from livemoe.train.grpo.trainer import GRPOTrainer

    student = make_student(tmp_path / "student")
    extra = ["--bf16", "true", "--reward_fns", "test_precision:varied", "--save_every", "1"]
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "run", *extra)))
    assert trainer.master is not None and trainer.model.lm_head_weight.dtype == torch.bfloat16
    trainer.train(evaluate=False)
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    masters = dict(zip([n for n, p in trainer.model.named_parameters() if p.requires_grad],
                       trainer.master.parameters()))
    start = state(student)
    saved = state(str(tmp_path / "run" / "checkpoints" / "step-00000002" / "model"))
    assert saved.keys() >= masters.keys() and len(masters) > 0
    for name, m in masters.items():
        assert torch.equal(saved[name], m.detach()), name  # the checkpoint holds the fp32 masters
        assert not torch.equal(m.detach(), start[name]), name
    # resuming from step 1 continues from its masters: the same step-2 masters
    resumed = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "run", *extra, "--resume",
                                                        str(tmp_path / "run" / "checkpoints" / "step-00000001"))))
    assert resumed.step == 1
    resumed.train(evaluate=False)
    for name, m in zip(masters, resumed.master.parameters()):
        assert torch.equal(m.detach(), masters[name]), name


def varied(record, completion, info):
    """A reward that differs between samples (a random model's answers all fail the judge)."""
    return (sum(map(ord, completion)) % 7) / 6.0
