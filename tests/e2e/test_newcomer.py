"""The newcomer's path: a Megatron-Core training script ported to the plugin, as the README shows it.

* The script's own ``parallel_state.initialize_model_parallel`` call: groups of the ``"moe"``
  layout's rank lists are taken (the run trains as without the call; Megatron's getters return
  groups of our rank lists; ``close()`` hands the script's groups back, alive); other groups give
  one ``ConfigError`` naming both layouts, the same on every rank.
* ``moe_plugin.transformer_config``: the parallel sizes written once, in the ``"moe"`` block.
* ``run.summary``: sizes, MoE layers, experts per rank, parameter counts (against one rank), the
  memory estimate's arithmetic.
* Seeds: a script that only calls ``torch.manual_seed`` (or DeepSpeed's ``set_random_seed``)
  builds the weights of an explicit ``seed=``; the 4-rank run starts from the one-rank model.
* ``run.data_parallel_rank / size`` agree with DeepSpeed's engine, also with EP folded over TP x DP.
* Errors every rank raises alike are printed by rank 0 only.

The model and data: ``tests/gpt_tiny.py`` with the MoE settings of ``test_gpt_layouts.py`` (dropless
top-2, no balance loss, z-loss on; ``SEED`` keeps the routes clear of ties).
"""
from __future__ import annotations

import io
import os

import pytest
import torch

from gpt_tiny import MODEL as TINY
from gpt_tiny import SEQ, VOCAB, micro_batches, one_rank_groups
import ds_json

B, SEED, STEPS = 8, 2, 3
MODEL = {**TINY, "add_bias_linear": False}
MOE = {"num_experts": 8, "router": "topk", "top_k": 2, "drop_tokens": False, "aux_loss_coeff": 0.0,
       "z_loss_coeff": 0.1, "layers": [0, 2, 3]}
TP2_EP2 = {"tensor": 2, "expert": 2}
FOLDED = {"tensor": 2, "expert": 4, "expert_tensor": 1}   # tp 2 x dp 2; ep 4 over TP x DP


def ds_config(parallel: dict, dp: int, stage: int = 1) -> dict:
    return ds_json.ds_config(batch=B, dp=dp, gas=1, clip=None, zero=stage, moe=MOE, parallel=parallel,
                             optimizer={"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}})


def provider(moe_config, groups):
    """The ported script's provider: sizes from the "moe" block, the seed from torch's generator."""
    import moe_plugin
    from megatron.core.models.gpt import GPTModel

    config = moe_plugin.transformer_config(moe_config, **MODEL, pipeline_dtype=torch.float32,
                                           use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                           bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                                           masked_softmax_fusion=False, apply_rope_fusion=False)
    torch.manual_seed(SEED)   # all the script does about seeds
    spec = moe_plugin.gpt_moe_spec(moe_config, config, groups)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _train(parallel: dict, dp: int) -> dict:
    """Initialize, train ``STEPS`` steps on this replica's share of each global batch, close."""
    import moe_plugin

    run = moe_plugin.initialize(ds_config(parallel, dp), provider, print_summary=False)
    try:
        from megatron.core import parallel_state as ps

        engine, groups = run.engine, run.groups
        out = {"summary": run.summary.to_dict(), "dp_rank": run.data_parallel_rank, "dp_size": run.data_parallel_size,
               "engine_dp": engine.dp_world_size, "losses": [],
               "engine_dp_ranks": torch.distributed.get_process_group_ranks(engine.data_parallel_group),
               "megatron": {k: torch.distributed.get_process_group_ranks(getattr(ps, getter)())
                            for k, getter in (("tp", "get_tensor_model_parallel_group"),
                                              ("dp", "get_data_parallel_group"),
                                              ("ep", "get_expert_model_parallel_group"),
                                              ("edp", "get_expert_data_parallel_group"))},
               "ours": {k: groups.ranks(k) for k in ("tp", "dp", "ep", "edp")}}
        for step in range(STEPS):
            [((tokens, positions), labels)] = micro_batches(step, B, run.data_parallel_rank, run.data_parallel_size, 1)
            loss = engine(tokens, positions, None, labels=labels).float().mean()
            engine.backward(loss)
            engine.step()
            value = loss.detach().reshape(1).clone()
            torch.distributed.all_reduce(value)   # every rank's: the mean over replicas, tp peers alike
            out["losses"].append(value.item() / torch.distributed.get_world_size())
        return out
    finally:
        run.close()


def _ported(rank: int, world_size: int) -> dict:
    import moe_plugin
    from megatron.core import parallel_state as ps

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out = {"plain": _train(TP2_EP2, dp=2)}

    # The script's own call, with the layout the "moe" block implies.
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    users_tp = ps.get_tensor_model_parallel_group()
    out["with_call"] = _train(TP2_EP2, dp=2)
    ones = torch.ones(1)
    torch.distributed.all_reduce(ones, group=ps.get_tensor_model_parallel_group())   # the script's group, alive
    out["after_close"] = {"same_handle": ps.get_tensor_model_parallel_group() is users_tp, "sum": ones.item()}
    ps.destroy_model_parallel()

    # Megatron's own expert parallelism, the same ranks: taken as well.
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    moe_plugin.initialize(ds_config(TP2_EP2, 2), provider, print_summary=False).close()
    ps.destroy_model_parallel()

    # Another layout: one ConfigError, the same on every rank.
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        moe_plugin.initialize(ds_config(TP2_EP2, 2), provider, print_summary=False)
    except moe_plugin.ConfigError as err:
        printed = io.StringIO()
        out["mismatch"] = {"message": str(err), "status": moe_plugin.report_error(err, file=printed),
                           "printed": printed.getvalue()}
    finally:
        ps.destroy_model_parallel()

    # A provider that returns no module: a TypeError every rank raises alike, printed once.
    try:
        moe_plugin.initialize(ds_config(TP2_EP2, 2), lambda moe_config, groups: None, print_summary=False)
    except TypeError as err:
        printed = io.StringIO()
        out["no_module"] = {"alike": moe_plugin.raised_alike(err), "status": moe_plugin.report_error(err, file=printed),
                            "printed": printed.getvalue()}

    out["folded"] = _train(FOLDED, dp=2)
    return out


def _one_rank(rank: int, world_size: int) -> dict:
    """The one-rank run, and the seed checks: torch.manual_seed / DeepSpeed's set_random_seed alone
    build the weights of an explicit seed."""
    from deepspeed.runtime.utils import set_random_seed
    from megatron.core.models.gpt import GPTModel

    import moe_plugin
    from moe_plugin.configs import MoEConfig
    from moe_plugin.integration.megatron import gpt_moe_spec

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    out = {"run": _train({}, dp=1)}
    with one_rank_groups() as groups:
        moe_config = MoEConfig.from_dict(MOE)
        config = moe_plugin.transformer_config(moe_config, **MODEL, use_cpu_initialization=True)

        def build(seed_torch, seed=None):
            seed_torch()
            model = GPTModel(config, gpt_moe_spec(moe_config, config, groups, seed=seed), vocab_size=VOCAB,
                             max_sequence_length=SEQ)
            return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

        explicit = build(lambda: torch.manual_seed(7), seed=7)
        out["seed_differs"] = [k for k, v in build(lambda: torch.manual_seed(7), seed=8).items()
                               if not torch.equal(v, explicit[k])]
        out["manual_seed"] = [k for k, v in build(lambda: torch.manual_seed(7)).items()
                              if not torch.equal(v, explicit[k])]
        out["set_random_seed"] = [k for k, v in build(lambda: set_random_seed(7)).items()
                                  if not torch.equal(v, explicit[k])]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dist import run_distributed

    tmp = tmp_path_factory.mktemp("newcomer")
    return {"one": run_distributed(_one_rank, 1, tmp)[0], "four": run_distributed(_ported, 4, tmp, timeout=400)}


@pytest.mark.slow
def test_users_initialize_model_parallel_is_taken_when_it_matches(results):
    for out in results["four"]:
        plain, called = out["plain"], out["with_call"]
        assert called["losses"] == plain["losses"]   # the same groups' ranks, the same arithmetic
        assert called["megatron"] == called["ours"]  # Megatron's getters: our rank lists while the run is on
        assert out["after_close"] == {"same_handle": True, "sum": 2.0}   # the script's groups are back, alive
    torch.testing.assert_close(results["four"][0]["plain"]["losses"], results["one"]["run"]["losses"],
                               rtol=1e-4, atol=1e-5)   # and the model is the one-rank model


@pytest.mark.slow
def test_users_initialize_model_parallel_with_another_layout_is_one_config_error(results):
    messages = {out["mismatch"]["message"] for out in results["four"]}
    assert len(messages) == 1, messages   # every rank the same line
    message = messages.pop()
    assert message.startswith("moe.parallel: got tp 2 x pp 1 x dp 2 x ep 2 x etp 2 x edp 1")
    assert "holds groups (initialize_model_parallel?) of tp 1 x pp 1 x dp 4 x cp 1 x ep 1 x etp 1 x edp 4" in message
    assert "their tp, dp groups" in message and "remove the initialize_model_parallel call" in message
    assert [out["mismatch"]["status"] for out in results["four"]] == [2] * 4
    assert [bool(out["mismatch"]["printed"]) for out in results["four"]] == [True, False, False, False]


@pytest.mark.slow
def test_errors_every_rank_raises_alike_print_once(results):
    for out in results["four"]:
        assert out["no_module"]["alike"] and out["no_module"]["status"] == 1
    assert results["four"][0]["no_module"]["printed"] == ("error: model_provider must return a torch.nn.Module, "
                                                          "got NoneType\n")
    assert all(out["no_module"]["printed"] == "" for out in results["four"][1:])


@pytest.mark.slow
def test_summary_numbers(results):
    one = results["one"]["run"]["summary"]
    for out in results["four"]:
        for case, ep, edp in (("plain", 2, 1), ("folded", 4, 1)):
            summary = out[case]["summary"]
            assert summary["sizes"] == {"world_size": 4, "tp": 2, "pp": 1, "dp": 2, "ep": ep,
                                        "etp": 2 if case == "plain" else 1, "edp": edp, "order": "tp-cp-ep-dp-pp"}
            assert summary["moe_layers"] == [0, 2, 3] and summary["experts_per_rank"] == 8 // ep
            assert summary["parameters"] == one["parameters"]   # each distinct parameter once over the ranks
    p = one["parameters"]
    assert p["dense"] + p["expert"] == p["total"] and p["active"] == p["dense"] + p["expert"] * 2 // 8
    assert one["experts_per_rank"] == 8 and one["zero_stage"] == 1 and one["dtype"] == "fp32"
    mem = one["memory_per_rank_mb"]   # one rank, fp32 Adam: 4 + 4 + 8 bytes per parameter
    assert mem["weights"] == round(p["total"] * 4 / 2 ** 20, 3)
    assert mem["optimizer"] == round(p["total"] * 8 / 2 ** 20, 3)
    assert mem["async_save_copy"] == round(p["total"] * 12 / 2 ** 20, 3)   # a checkpoint's 12 bytes per parameter
    four = results["four"][0]["plain"]["summary"]["memory_per_rank_mb"]
    assert 0 < four["weights"] < mem["weights"] and four["total"] < mem["total"]


@pytest.mark.slow
def test_data_parallel_rank_and_size_agree_with_deepspeed(results):
    for rank, out in enumerate(results["four"]):
        for case in ("plain", "with_call", "folded"):
            run = out[case]
            assert run["dp_size"] == run["engine_dp"] == 2
            assert run["engine_dp_ranks"] == run["ours"]["dp"] and run["ours"]["dp"].index(rank) == run["dp_rank"]


@pytest.mark.slow
def test_weights_follow_torch_seed(results):
    one = results["one"]
    assert one["seed_differs"]   # the seed matters ...
    assert one["manual_seed"] == [] and one["set_random_seed"] == []   # ... and torch's is the default


def test_transformer_config_takes_the_sizes_from_the_block(tmp_path):
    import json

    import moe_plugin

    block = {"train_batch_size": 8, "moe": {"num_experts": 4, "parallel": {"tensor": 2, "pipeline": 2,
                                                                             "sequence_parallel": True}}}
    moe_config = moe_plugin.MoEConfig.from_ds_config(block)
    assert moe_config.megatron_parallel_fields() == {"tensor_model_parallel_size": 2,
                                                     "pipeline_model_parallel_size": 2, "sequence_parallel": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(block))
    for source in (moe_config, block, str(path)):
        config = moe_plugin.transformer_config(source, **MODEL, pipeline_dtype=torch.float32,
                                               tensor_model_parallel_size=2)   # repeating an equal value is fine
        assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.sequence_parallel) \
            == (2, 2, True)
        assert config.num_layers == MODEL["num_layers"]
    with pytest.raises(moe_plugin.ConfigError, match=r"^moe.parallel.tensor: got 2; transformer_config was also "
                                                      r"given tensor_model_parallel_size=1; leave it out"):
        moe_plugin.transformer_config(moe_config, **MODEL, tensor_model_parallel_size=1)
    with pytest.raises(TypeError, match="transformer_config takes a MoEConfig"):
        moe_plugin.transformer_config(3, **MODEL)


@pytest.mark.parametrize("rank, printed", [("0", True), ("3", False)])
def test_exit_on_error_reports_alike_errors_once_and_lets_others_through(monkeypatch, capsys, rank, printed):
    import moe_plugin

    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as stop:
        with moe_plugin.exit_on_error():
            raise moe_plugin.alike_on_every_rank(TypeError("model_provider must return a torch.nn.Module"))
    assert stop.value.code == 1
    assert capsys.readouterr().err == ("error: model_provider must return a torch.nn.Module\n" if printed else "")
    with pytest.raises(SystemExit) as stop:
        with moe_plugin.exit_on_config_error():   # the older name: the same
            raise moe_plugin.ConfigError("moe.num_experts", 3, "expected 4")
    assert stop.value.code == 2
    with pytest.raises(KeyError):   # one rank's own error: its traceback, not a line
        with moe_plugin.exit_on_error():
            raise KeyError("only here")


LAUNCHED_SCRIPT = '''\
import sys
import deepspeed
from megatron.core import parallel_state
import moe_plugin

deepspeed.init_distributed(dist_backend="gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)   # the script's own, another layout
with moe_plugin.exit_on_error():
    moe_plugin.initialize(sys.argv[-1], lambda moe_config, groups: None)
'''


@pytest.mark.slow
def test_launcher_prints_the_group_mismatch_once(tmp_path):
    """Under the deepspeed launcher (2 ranks): the item that every rank raises after the groups exist
    is one line, from rank 0, and status 2: no traceback, no second copy."""
    from launcher import jobs

    script = tmp_path / "user.py"
    script.write_text(LAUNCHED_SCRIPT)
    config = tmp_path / "ds.json"
    ds_json.write_ds_config(config, batch=2, micro=2, gas=1, optimizer=None, zero=None, clip=None,
                            moe={"num_experts": 2}, parallel={"tensor": 2})
    [done] = jobs([[str(script), str(config)]], cwd=tmp_path, timeout=300)
    status, output = done.status, done.output
    errors = [line for line in output.splitlines() if "error: " in line and "launch.py" not in line]
    assert status == 2 and len(errors) == 1, output
    assert errors[0].startswith("error: moe.parallel: got tp 2 x pp 1 x dp 1 x ep 1 x etp 2 x edp 1 (order "
                                "tp-cp-ep-dp-pp); megatron.core.parallel_state already holds groups"), output
    assert "Traceback" not in output, output
