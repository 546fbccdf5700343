"""Config files from elsewhere (issue 42, items 2 and 3): every bad value is one line
``error: FILE[: KEY]: what is wrong; what is valid``, status 2, no traceback, nothing written.

A DeepSpeed JSON read as DeepSpeed reads it (hjson): numbers out of range, nesting past 100 levels,
bare NaN / Infinity (the key path and the true position), bytes that are not UTF-8. A Hugging Face
``config.json`` through ``moe-plugin import-hf``, on tampered copies of one tiny Mixtral: the wrong
kind of JSON, sizes of the wrong type or range, sizes that disagree with each other or with the
safetensors headers (hidden size, vocabulary, layers, experts), tensors of the wrong shape; in every
family, a tensor of the wrong shape named with its file. A config of 10**6 layers over the weights of
2 is refused by a child whose peak memory stays that of the command's start.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_tiny import EXPERTS, MODELS, save_tiny_model

from moe_plugin.configs import ConfigError, load_ds_config


# -- the DeepSpeed JSON -----------------------------------------------------------------------

DS_CASES = [
    (b'{"train_batch_size": 8, "moe": {"capacity_factor": 1e400}}',
     "moe.capacity_factor: got 1e400; beyond the range of a number"),
    (b'{"moe": {"num_experts": -1e400}}', "moe.num_experts: got -1e400; beyond the range of a number"),
    (b'{"moe": {"num_experts": ' + b"9" * 5000 + b'}}',
     "moe.num_experts: got a number of 5000 characters; beyond the range of a number"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "got lists and objects nested 101 deep at line 1 column 106; a DeepSpeed JSON nests a few levels "
     "(at most 100 are read)"),
    (b'{"train_batch_size": 8,\n "moe": {"capacity_factor": NaN}}',
     "moe.capacity_factor: got NaN at line 2 column 29; JSON has no NaN or Infinity"),
    (b'{\n  "gradient_clipping": Infinity\n}', "gradient_clipping: got Infinity at line 2 column 24; JSON has no NaN"),
    (b'{"moe": {"layers": [0, -Infinity]}}', "moe.layers[1]: got -Infinity at line 1 column 24; JSON has no NaN"),
    (b'{\n  // hjson\n  moe: {capacity_factor: NaN}\n}', "moe.capacity_factor: got NaN at line 3 column 26; JSON"),
    (b'{"moe": {"num_experts": 8}, "name": "caf\xe9"}',
     "got byte 0xe9 at line 1 column 41, not UTF-8; a DeepSpeed JSON is UTF-8 text: save it as UTF-8"),
]


@pytest.mark.parametrize("data, message", DS_CASES, ids=["1e400", "-1e400", "5000 digits", "nested", "NaN",
                                                         "Infinity", "-Infinity in a list", "NaN in hjson",
                                                         "latin-1"])
def test_a_bad_deepspeed_json_is_one_line_naming_the_file_and_key(tmp_path, data, message):
    path = tmp_path / "ds.json"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as caught:
        load_ds_config(path)
    assert str(caught.value).startswith(f"DeepSpeed config {path}: {message}"), str(caught.value)
    assert "\n" not in str(caught.value)


def test_what_hjson_reads_well_is_read_as_before(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "name": "a, NaN", x: [[[1]]],\n  "moe": {"capacity_factor": 1.0, "lr": 1e-300},\n}\n')
    assert load_ds_config(path) == {"name": "a, NaN", "x": [[[1]]], "moe": {"capacity_factor": 1, "lr": 1e-300}}


# -- a Hugging Face config.json, through the command ------------------------------------------

@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return Path(save_tiny_model("mixtral", str(tmp_path_factory.mktemp("hf") / "mixtral")))


def _tampered(source: Path, target: Path, config=None, tensors=None, raw: bytes | None = None) -> Path:
    """A copy of ``source`` whose config.json is ``config(dict)`` (or the bytes ``raw``) and whose
    weights are ``tensors(dict)`` changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if config is not None:
        (target / "config.json").write_text(json.dumps(config(json.loads((target / "config.json").read_text()))))
    if raw is not None:
        (target / "config.json").write_bytes(raw)
    if tensors is not None:
        weights = load_file(str(target / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _import_line(hf: Path, tmp_path: Path, capsys) -> str:
    """The one line ``moe-plugin import-hf`` prints for ``hf`` (status 2, nothing written)."""
    from moe_plugin_tools.cli import main

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"moe": {"num_experts": EXPERTS}}))
    out = tmp_path / f"ckpt-{hf.name}"
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        main(["import-hf", str(hf), "--config", str(ds), "--out", str(out)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()
    return err.strip()


def _with(**values):
    return lambda config: {**config, **values}


def _shorter(name: str):
    def change(weights):
        weights[name] = weights[name][: weights[name].shape[0] // 2].contiguous()
    return change


def _transposed(name: str):
    def change(weights):
        weights[name] = weights[name].t().contiguous()
    return change


HF_CASES = {   # id: (config change, tensor change, raw bytes, the line after "error: HF/")
    "a list": (lambda config: [config], None, None,
               "config.json: got a JSON list; expected a JSON object at the top level"),
    "a string size": (_with(hidden_size="64"), None, None,
                      "config.json: hidden_size: got '64'; expected an integer >= 1 (write the number without "
                      "quotes: 64)"),
    "a negative size": (_with(hidden_size=-64), None, None, "config.json: hidden_size: got -64; expected an integer "
                                                            ">= 1"),
    "a zero layer interval": (_with(moe_layer_interval=0), None, None,   # ERNIE-4.5's key: a modulo by it
                              "config.json: moe_layer_interval: got 0; expected an integer >= 1"),
    "a bool size": (_with(num_hidden_layers=True), None, None,
                    "config.json: num_hidden_layers: got True; expected an integer >= 1"),
    "3 heads": (_with(num_attention_heads=3), None, None,
                "config.json: num_attention_heads: got 3; must divide hidden_size (64): without head_dim each head "
                "is hidden_size / num_attention_heads wide"),
    "3 query groups": (_with(num_key_value_heads=3), None, None,
                       "config.json: num_key_value_heads: got 3; must divide num_attention_heads (4): each query "
                       "group is a whole number of heads"),
    "top-k past the experts": (_with(num_experts_per_tok=9), None, None,
                               "config.json: num_experts_per_tok: got 9; expected at most the 8 experts"),
    "hidden 66": (_with(hidden_size=66), None, None,
                  "config.json: hidden_size: got 66; the weights are 64 wide (model.embed_tokens.weight [384, 64] "
                  "in HF/model.safetensors)"),
    "vocabulary 0": (_with(vocab_size=0), None, None, "config.json: vocab_size: got 0; expected an integer >= 1"),
    "vocabulary 10**12": (_with(vocab_size=10 ** 12), None, None,
                          "config.json: vocab_size: got 1000000000000; the embedding has 384 rows "
                          "(model.embed_tokens.weight [384, 64] in HF/model.safetensors)"),
    "epsilon NaN": (_with(rms_norm_eps=float("nan")), None, None,
                    "config.json: rms_norm_eps: got nan; expected a finite number > 0"),
    "epsilon 0": (_with(rms_norm_eps=0.0), None, None,
                  "config.json: rms_norm_eps: got 0.0; expected a finite number > 0"),
    "rope_theta Infinity": (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_theta": float("inf")}},
                            None, None,
                            "config.json: rope_parameters.rope_theta: got inf; expected a finite number > 0"),
    "10**6 layers": (_with(num_hidden_layers=10 ** 6), None, None,
                     "config.json: num_hidden_layers: got 1000000; the weights hold 2 decoder layers (model.layers.0 "
                     "to model.layers.1); expected 2"),
    "1 layer of 2": (_with(num_hidden_layers=1), None, None,
                     "config.json: num_hidden_layers: got 1; the weights hold 2 decoder layers"),
    "10**9 experts": (_with(num_local_experts=10 ** 9), None, None,
                      "config.json: num_local_experts: got 1000000000; the router has 8 rows "
                      "(model.layers.0.block_sparse_moe.gate.weight [8, 64] in HF/model.safetensors)"),
    "a value transformers refuses": (_with(router_aux_loss_coef="x"), None, None,
                                     "config.json: got refused by transformers (StrictDataclassFieldValidationError: "
                                     "Validation error for field 'router_aux_loss_coef'"),
    "half a q_proj": (None, _shorter("model.layers.1.self_attn.q_proj.weight"), None,
                      "model.safetensors: model.layers.1.self_attn.q_proj.weight: got shape [32, 64]; "
                      "HF/config.json makes it [64, 64] (num_attention_heads 4, num_key_value_heads 2, head_dim 16, "
                      "hidden_size 64)"),
    "a transposed expert": (None, _transposed("model.layers.1.block_sparse_moe.experts.5.w2.weight"), None,
                            "model.safetensors: model.layers.1.block_sparse_moe.experts.5.w2.weight: got shape "
                            "[32, 64]; HF/config.json makes it [64, 32] (intermediate_size 32, hidden_size 64)"),
    "a truncated file": (None, None, b'{"model_type": "mixtral", "hidden_size": 64, "num_',
                         "config.json: got invalid JSON at line 1 column 46 (Unterminated string starting at); "
                         "expected a JSON object, as save_pretrained writes it (a truncated or damaged file?)"),
    "latin-1": (None, None, b'{"model_type": "mixtral", "name": "caf\xe9"}',
                "config.json: got byte 0xe9 at line 1 column 39, not UTF-8; a config.json is UTF-8 text"),
}


def test_a_bad_config_json_is_one_line_naming_the_file_and_key(mixtral, tmp_path, capsys):
    """Each case of ``HF_CASES`` through ``moe-plugin import-hf`` (in this process: its own line,
    status 2, nothing written)."""
    for n, (case, (config, tensors, raw, message)) in enumerate(HF_CASES.items()):
        hf = _tampered(mixtral, tmp_path / f"hf{n}", config, tensors, raw)
        line = _import_line(hf, tmp_path, capsys)
        assert line.startswith(f"error: {hf}/" + message.replace("HF/", f"{hf}/")), (case, line)


def test_a_config_of_a_million_layers_is_refused_at_the_memory_of_the_start(mixtral, tmp_path):
    """import-hf of ``num_hidden_layers`` 10**6 over 2 layers' weights, as a user runs it: one line, and
    the child's peak memory (its own rusage) that of a command that imports nothing (it once grew past
    5.9 GB over 10 minutes)."""
    hf = _tampered(mixtral, tmp_path / "hf", _with(num_hidden_layers=10 ** 6))
    (tmp_path / "ds.json").write_text(json.dumps({"moe": {"num_experts": EXPERTS}}))
    err = tmp_path / "err"
    with open(err, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "moe_plugin_tools.cli", "import-hf", str(hf), "--config",
                                  str(tmp_path / "ds.json"), "--out", str(tmp_path / "ckpt")],
                                 stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            _pid, status, usage = os.wait4(child.pid, 0)
        finally:
            child.returncode = 0   # reaped here
    lines = err.read_text().splitlines()
    assert os.waitstatus_to_exitcode(status) == 2 and lines == [
        f"error: {hf}/config.json: num_hidden_layers: got 1000000; the weights hold 2 decoder layers "
        "(model.layers.0 to model.layers.1); expected 2"], lines[-5:]
    assert usage.ru_maxrss < 1 << 20, f"peak {usage.ru_maxrss} KiB"   # the command's start: about 250 MB
    assert not (tmp_path / "ckpt").exists()


# -- every family -----------------------------------------------------------------------------

def _families() -> list[str]:
    from moe_plugin.interop.families import MODEL_TYPES

    return list(MODEL_TYPES)


FAMILIES = _families()   # the registry's model types; tests/hf_tiny.py has a tiny model of each


def test_every_family_names_a_tensor_of_the_wrong_shape(tmp_path):
    """In each registered family, an attention tensor and an MLP (expert) tensor one row longer
    are refused before anything is written, naming the tensor and its file."""
    from safetensors.torch import load_file, save_file

    from moe_plugin.interop import import_hf

    assert len(FAMILIES) >= 13 and all(name in MODELS for name in FAMILIES), [n for n in FAMILIES if n not in MODELS]
    for name in FAMILIES:
        source = Path(save_tiny_model(name, str(tmp_path / name)))
        weights = load_file(str(source / "model.safetensors"))
        attention = next(k for k in sorted(weights) if ".self_attn." in k and k.endswith("proj.weight"))
        mlp = next(k for k in sorted(weights) if ".experts." in k or ".mlp.down_proj" in k)
        for tensor in (attention, mlp):
            changed = dict(weights)
            changed[tensor] = torch.cat([weights[tensor], weights[tensor][:1]])
            hf = tmp_path / f"{name}-tampered"
            shutil.rmtree(hf, ignore_errors=True)
            shutil.copytree(source, hf)
            save_file(changed, str(hf / "model.safetensors"), metadata={"format": "pt"})
            with pytest.raises(ConfigError) as caught:
                import_hf(hf, {"moe": {"num_experts": EXPERTS}}, tmp_path / "ckpt", progress=lambda line: None)
            assert str(caught.value).startswith(f"{hf}/model.safetensors: {tensor}: got shape "), str(caught.value)
            assert f"{hf}/config.json makes it" in str(caught.value) and not (tmp_path / "ckpt").exists()


# -- export-hf: the sizes a checkpoint records --------------------------------------------------

@pytest.fixture(scope="module")
def imported(mixtral, tmp_path_factory) -> Path:
    from moe_plugin.interop import import_hf

    out = tmp_path_factory.mktemp("ckpt") / "mixtral"
    import_hf(mixtral, {"moe": {"num_experts": EXPERTS}}, out, progress=lambda line: None)
    return out


def _transformer_config(**values):
    return lambda meta: meta["model"]["transformer_config"].update(values)


EXPORT_CASES = {   # id: (metadata change, the line after "error: TAG/")
    "3 heads": (_transformer_config(num_attention_heads=3),
                "moe_plugin.json: model.transformer_config.num_query_groups: got 2; must divide "
                "num_attention_heads (3)"),
    "hidden 66": (_transformer_config(hidden_size=66),
                  ": embedding.word_embeddings.weight: got shape [384, 64]; the recorded architecture makes it "
                  "[384, 66] (vocab_size 384, hidden_size 66)"),
    "a string size": (_transformer_config(hidden_size="64"),
                      "moe_plugin.json: model.transformer_config.hidden_size: got '64'; expected an integer >= 1"),
    "epsilon NaN": (_transformer_config(layernorm_epsilon=float("nan")),
                    "moe_plugin.json: model.transformer_config.layernorm_epsilon: got nan; expected a finite "
                    "number > 0"),
    "10**6 layers": (_transformer_config(num_layers=10 ** 6),
                     "moe_plugin.json: model.transformer_config.num_layers: got 1000000; the checkpoint holds 2 "
                     "decoder layers (decoder.layers.N); expected 2"),
    "a list for the HF config": (lambda meta: meta["hf"].update(config=[1]),
                                 "moe_plugin.json: hf.config: got a JSON list; expected an object"),
}


def test_export_refuses_recorded_sizes_that_disagree_in_one_line(imported, tmp_path, capsys):
    """``moe-plugin export-hf`` of tampered metadata (nothing else checks it: no checksum covers the
    metadata itself): one line naming the file and key, status 2, no output directory."""
    from moe_plugin_tools.cli import main

    for n, (case, (change, message)) in enumerate(EXPORT_CASES.items()):
        ckpt = tmp_path / f"ckpt{n}"
        shutil.copytree(imported, ckpt)
        meta_path = ckpt / "step0" / "moe_plugin.json"
        meta = json.loads(meta_path.read_text())
        change(meta)
        meta_path.write_text(json.dumps(meta))
        out = tmp_path / f"out{n}"
        capsys.readouterr()
        with pytest.raises(SystemExit) as caught:
            main(["export-hf", str(ckpt), "--out", str(out)])
        err = capsys.readouterr().err
        assert caught.value.code == 2 and len(err.splitlines()) == 1, (case, err)
        want = f"error: {ckpt / 'step0'}" + ("" if message.startswith(":") else "/") + message
        assert err.startswith(want), (case, err)
        assert not out.exists() and not list(tmp_path.glob(".tmp-*")), case
