"""``moe-plugin preprocess --chat`` (moe_plugin/data/chat.py): conversations to tokens and a loss mask.

* A byte-level BPE trained here once, given five chat templates: ChatML (Qwen2.5-like: a default
  system prompt, multi-turn), a Llama-2-like one (a system prompt in ``<<SYS>>``, BOS, no generation
  prompt, unknown roles refused), a Qwen3-like one (earlier turns' ``<think>`` dropped: not
  prefix-stable), ChatML with DeepSeek-R1's ``<think>`` generation prompt, and a bare Q/A one (an
  empty answer renders to nothing).
* Through ``main`` (the command's entry point): every conversation's tokens are
  ``apply_chat_template(..., tokenize=True)``'s, and the mask's runs of 1 decode to each assistant
  turn's content + its end-of-turn marker, nothing else; ``read_chat_dataset`` reads both back,
  ``PREFIX.json`` and the printed line have the counts. As the user runs it (``python -m
  moe_plugin_tools.cli``, 2 workers; slow): the same bytes as 1 worker.
* The Qwen3-like template is refused naming ``FILE:LINE`` and the turn; ``--chat-split-turns`` gives
  one document per turn, only that turn masked. The R1-like one, on answers without reasoning, is
  refused split or not.
* Each bad line stops the run in one line naming ``FILE:LINE`` and leaves no file; a tokenizer
  without a chat template, ``--json-keys`` with ``--chat`` are refused; a mask of other documents
  is refused by ``read_chat_dataset``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from moe_plugin.configs import ConfigError
from moe_plugin_tools.cli import main
from launcher import REPO
from tests.e2e.test_preprocess import _files, _refused

EOS = "<|endoftext|>"
CHATML = ("{%- if messages[0].role != 'system' %}"
          "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
          "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA = ("{{- bos_token }}{%- for m in messages %}"
         "{%- if m.role == 'system' %}{{- '<<SYS>>\\n' + m.content + '\\n<</SYS>>\\n\\n' }}"
         "{%- elif m.role == 'user' %}{{- '[INST] ' + m.content + ' [/INST]' }}"
         "{%- elif m.role == 'assistant' %}{{- ' ' + m.content + eos_token }}"
         "{%- else %}{{- raise_exception('Unknown role: ' + m.role) }}{%- endif %}{%- endfor %}")
QWEN3 = ("{%- set ns = namespace(last_query=-1) %}"
         "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
         "{%- endfor %}"
         "{%- for m in messages %}{%- set content = m.content %}"
         "{%- if m.role == 'assistant' and '</think>' in content and loop.index0 < ns.last_query %}"
         "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
         "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
R1 = CHATML.replace("'<|im_start|>assistant\\n' }}{%- endif %}", "'<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
BARE = "{%- for m in messages %}{%- if m.role == 'user' %}{{- '\\nQ: ' + m.content + '\\nA:' }}{%- else %}" \
       "{{- m.content }}{%- endif %}{%- endfor %}"
END = {"chatml": "<|im_end|>\n", "llama": EOS, "qwen3": "<|im_end|>\n", "bare": ""}   # after each assistant turn
START = {"llama": " "}                                                                # before it, generated too


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


CHATS = [
    [_user("What is the capital of France?"), _assistant("Paris.")],
    [{"role": "system", "content": "Answer in one word."}, _user("Capital of Spain?"), _assistant("Madrid."),
     _user("And of Italy?"), _assistant("Rome, of course."), _user("Thanks!"), _assistant("")],
    [_user("Say something in French."), _assistant("Un café, s'il vous plaît ✓")],
]
THINK = [_user("Capital of France?"), _assistant("<think>\nIt is Paris.\n</think>\n\nParis."),
         _user("And Spain?"), _assistant("<think>\nMadrid, surely.\n</think>\n\nMadrid.")]


def _jsonl(path: Path, chats: list, key: str = "messages") -> Path:
    path.write_text("".join(json.dumps({key: chat, "id": i}) + "\n" for i, chat in enumerate(chats)))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """Tokenizer directories: one BPE, trained once, with each template (and one without)."""
    from transformers import AutoTokenizer

    from moe_plugin.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("chat")
    words = [m["content"] for chat in CHATS + [THINK] for m in chat] + ["system user assistant think"]
    train_bpe_tokenizer(words * 8, root / "plain", vocab_size=320)
    dirs = {"plain": root / "plain"}
    for name, template in {"chatml": CHATML, "llama": LLAMA, "qwen3": QWEN3, "r1": R1, "bare": BARE}.items():
        tokenizer = AutoTokenizer.from_pretrained(str(root / "plain"))
        tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
        tokenizer.add_special_tokens({"bos_token": "<s>"})
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(root / name))
        dirs[name] = root / name
    return SimpleNamespace(root=root, dirs=dirs, load=lambda name: AutoTokenizer.from_pretrained(str(dirs[name])))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) of each run of 1s."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in edges.reshape(-1, 2)]


def _check_conversation(tokenizer, template: str, chat: list, tokens: np.ndarray, mask: np.ndarray) -> None:
    """The tokens are the template's; the mask is 1 exactly on what each assistant turn generates."""
    assert tokens.tolist() == list(tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"])
    assert mask.dtype == np.uint8 and len(mask) == len(tokens) and set(np.unique(mask)) <= {0, 1}
    expected = [START.get(template, "") + m["content"] + END[template] for m in chat if m["role"] == "assistant"]
    expected = [text for text in expected if text]
    runs = _runs(mask)
    assert [tokenizer.decode(tokens[a:b].tolist()) for a, b in runs] == expected
    # and what is left unmasked is the rest of the rendering, in order
    pieces, at = [], 0
    for a, b in runs:
        pieces += [tokenizer.decode(tokens[at:a].tolist()), tokenizer.decode(tokens[a:b].tolist())]
        at = b
    pieces.append(tokenizer.decode(tokens[at:].tolist()))
    assert "".join(pieces) == tokenizer.apply_chat_template(chat, tokenize=False)


def _read(prefix: Path):
    from moe_plugin.data import read_chat_dataset

    tokens, mask = read_chat_dataset(prefix)
    return [(np.array(tokens[i]), np.array(mask[i])) for i in range(len(tokens))]   # copies: the maps close with them


def _preprocess_chatml(tok, jsonl: Path, prefix: Path) -> None:
    assert main(["preprocess", "--chat", "--input", str(jsonl), "--tokenizer", str(tok.dirs["chatml"]),
                 "--output-prefix", str(prefix), "--workers", "1", "--no-progress"]) == 0


def test_chatml_tokens_masks_counts_and_files(tok, tmp_path, capsys):
    from moe_plugin.data import is_chat_dataset

    jsonl = _jsonl(tmp_path / "chats.jsonl", CHATS * 3)
    prefix = tmp_path / "out" / "chats"
    _preprocess_chatml(tok, jsonl, prefix)
    tokenizer = tok.load("chatml")
    documents = _read(prefix)
    assert len(documents) == 9
    for chat, (tokens, mask) in zip(CHATS * 3, documents):
        _check_conversation(tokenizer, "chatml", chat, tokens, mask)
    assert documents[1][1].sum() > 0 and documents[0][0].dtype == np.uint16 and is_chat_dataset(prefix)

    manifest = json.loads(Path(f"{prefix}.json").read_text())
    tokens, loss = sum(len(t) for t, _ in documents), sum(int(m.sum()) for _, m in documents)
    assert manifest | {"input": None, "tokenizer": None, "eod": None} == {
        "input": None, "tokenizer": None, "eod": None, "format": "chat", "chat_key": "messages", "split_turns": False,
        "vocab_size": len(tokenizer), "dtype": "uint16", "loss_mask": "chats_loss_mask", "conversations": 9,
        "documents": 9, "tokens": tokens, "loss_tokens": loss, "dropped": 0}
    assert (f"chats_loss_mask.bin/.idx: 9 conversations, 0 dropped (nothing to learn), {tokens:,} uint16 tokens, "
            f"{loss:,} masked (in the loss)") in capsys.readouterr().out
    assert _files(prefix.parent) == ["chats.bin", "chats.idx", "chats.json", "chats_loss_mask.bin",
                                     "chats_loss_mask.idx"]


@pytest.mark.slow   # 2 worker processes
def test_the_command_as_the_user_runs_it_with_two_workers_writes_the_same_bytes(tok, tmp_path):
    jsonl = _jsonl(tmp_path / "chats.jsonl", CHATS * 3)
    prefix = tmp_path / "two"
    done = subprocess.run([sys.executable, "-m", "moe_plugin_tools.cli", "preprocess", "--chat", "--input", str(jsonl),
                           "--tokenizer", str(tok.dirs["chatml"]), "--output-prefix", str(prefix), "--workers", "2"],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "100%" in done.stderr and "9 conversations, 0 dropped" in done.stdout
    _preprocess_chatml(tok, jsonl, tmp_path / "one")
    for suffix in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx"):
        assert Path(f"{tmp_path / 'one'}{suffix}").read_bytes() == Path(f"{prefix}{suffix}").read_bytes(), suffix


def test_a_system_prompt_template_with_bos_and_no_generation_prompt(tok, tmp_path, capsys):
    jsonl = _jsonl(tmp_path / "in.jsonl", CHATS, key="conversation")
    common = ["preprocess", "--chat", "--tokenizer", str(tok.dirs["llama"]), "--workers", "1", "--no-progress"]
    assert main([*common, "--input", str(jsonl), "--output-prefix", str(tmp_path / "d"), "--chat-key",
                 "conversation"]) == 0
    tokenizer = tok.load("llama")
    documents = _read(tmp_path / "d")
    assert len(documents) == 3 and documents[0][0][0] == tokenizer.bos_token_id
    assert "<<SYS>>" in tokenizer.decode(documents[1][0].tolist())
    for chat, (tokens, mask) in zip(CHATS, documents):
        _check_conversation(tokenizer, "llama", chat, tokens, mask)
    assert json.loads((tmp_path / "d.json").read_text())["chat_key"] == "conversation"

    tool = [_user("Weather?"), {"role": "tool", "content": "sunny"}, _assistant("Sunny.")]
    _jsonl(tmp_path / "tool.jsonl", [CHATS[0], tool], key="conversation")
    _refused(capsys, [*common, "--input", str(tmp_path / "tool.jsonl"), "--output-prefix", str(tmp_path / "t"),
                      "--chat-key", "conversation"],
             r"tool\.jsonl:2: conversation\[1\]: got role 'tool'; the chat template refuses this message: "
             r"Unknown role: tool")
    assert not list(tmp_path.glob("t.*")) and not list(tmp_path.glob("t_*"))


def test_a_prefix_unstable_template_is_refused_naming_the_turn_and_split_turns_are_exact(tok, tmp_path, capsys):
    jsonl = _jsonl(tmp_path / "think.jsonl", [THINK[:2], THINK])
    common = ["preprocess", "--chat", "--input", str(jsonl), "--tokenizer", str(tok.dirs["qwen3"]), "--workers", "1",
              "--no-progress"]
    _refused(capsys, [*common, "--output-prefix", str(tmp_path / "d")],
             r"think\.jsonl:2: messages\[1\]: got assistant turn 1; the chat template is not prefix-stable: "
             r"messages\[:2\] does not render to a token prefix of the whole conversation .*--chat-split-turns")
    assert _files(tmp_path) == ["think.jsonl"]

    assert main([*common, "--output-prefix", str(tmp_path / "d"), "--chat-split-turns"]) == 0
    assert "2 conversations as 3 turn documents" in capsys.readouterr().out
    tokenizer = tok.load("qwen3")
    documents = _read(tmp_path / "d")
    assert len(documents) == 3   # turn 1 of the first; turns 1 and 3 of the second
    for (tokens, mask), upto in zip(documents, [THINK[:2], THINK[:2], THINK]):
        assert tokens.tolist() == list(tokenizer.apply_chat_template(upto, tokenize=True)["input_ids"])
        (a, b), = _runs(mask)   # one run, to the end: only the last turn
        assert b == len(tokens) and tokenizer.decode(tokens[a:].tolist()) == upto[-1]["content"] + "<|im_end|>\n"
    assert "It is Paris" not in tokenizer.decode(documents[2][0].tolist())   # the template dropped it here
    manifest = json.loads((tmp_path / "d.json").read_text())
    assert (manifest["split_turns"], manifest["conversations"], manifest["documents"]) == (True, 2, 3)

    # a generation prompt that an answer without reasoning does not start with (DeepSeek-R1's "<think>\n"):
    # no mask to be found, split or not
    _jsonl(tmp_path / "plain.jsonl", CHATS[:1])
    for split in ([], ["--chat-split-turns"]):
        _refused(capsys, [*common, "--input", str(tmp_path / "plain.jsonl"), "--tokenizer", str(tok.dirs["r1"]),
                          "--output-prefix", str(tmp_path / "r1"), *split],
                 r"plain\.jsonl:1: messages\[1\]: got assistant turn 1; the chat template is not prefix-stable: "
                 r"messages\[:1\] with the generation prompt does not render to a token prefix of messages\[:2\]")
    assert not list(tmp_path.glob("r1*"))


def test_a_conversation_with_nothing_to_learn_is_dropped_and_counted(tok, tmp_path, capsys):
    chats = [CHATS[0], [_user("Silence?"), _assistant("")], CHATS[2]]
    jsonl = _jsonl(tmp_path / "in.jsonl", chats)
    assert main(["preprocess", "--chat", "--input", str(jsonl), "--tokenizer", str(tok.dirs["bare"]),
                 "--output-prefix", str(tmp_path / "d"), "--workers", "1", "--no-progress"]) == 0
    assert "3 conversations, 1 dropped (nothing to learn)" in capsys.readouterr().out
    tokenizer = tok.load("bare")
    documents = _read(tmp_path / "d")
    assert len(documents) == 2
    for chat, (tokens, mask) in zip([chats[0], chats[2]], documents):
        _check_conversation(tokenizer, "bare", chat, tokens, mask)
    manifest = json.loads((tmp_path / "d.json").read_text())
    assert (manifest["conversations"], manifest["documents"], manifest["dropped"]) == (3, 2, 1)


def test_bad_lines_are_refused_naming_the_line_and_leave_no_file(tok, tmp_path, capsys):
    good = json.dumps({"messages": CHATS[0]})
    cases = {
        "array": ("[1, 2]", r"array\.jsonl:2: got a JSON list; expected a JSON object with the key 'messages' "
                            r"\(--chat-key\)"),
        "notjson": ('{"messages": [', r"notjson\.jsonl:2: got '\{\"messages\": \['; expected one JSON object per line"),
        "nokey": ('{"text": "hi"}', r"nokey\.jsonl:2: got no 'messages'; the object has no key 'messages' "
                                    r"\(--chat-key\); its keys: 'text'"),
        "notlist": ('{"messages": "hi"}', r"notlist\.jsonl:2: messages: got a JSON string; expected a non-empty list "
                                          r"of \{role, content\} objects"),
        "empty": ('{"messages": []}', r"empty\.jsonl:2: messages: got an empty list; expected a non-empty list"),
        "notobject": ('{"messages": [["user", "hi"]]}', r"notobject\.jsonl:2: messages\[0\]: got a JSON array; "
                                                        r"expected a \{role, content\} object"),
        "nocontent": ('{"messages": [{"role": "user"}]}', r"nocontent\.jsonl:2: messages\[0\]: got no 'content'; "
                                                          r"expected a string at 'content'"),
        "badcontent": ('{"messages": [{"role": "user", "content": 3}]}',
                       r"badcontent\.jsonl:2: messages\[0\]: got a JSON number at 'content'"),
        "noassistant": (json.dumps({"messages": [_user("hi"), _user("again")]}),
                        r"noassistant\.jsonl:2: messages: got roles \['user', 'user'\]; expected at least one "
                        r"message with role 'assistant'"),
        "assistantfirst": (json.dumps({"messages": [_assistant("hi"), _user("a")]}),
                           r"assistantfirst\.jsonl:2: messages\[0\]: got an assistant turn first; expected a message "
                           r"before the first assistant turn"),
    }
    common = ["preprocess", "--chat", "--tokenizer", str(tok.dirs["chatml"]), "--workers", "1", "--no-progress"]
    for name, (line, match) in cases.items():
        (tmp_path / f"{name}.jsonl").write_text(good + "\n" + line + "\n")
        _refused(capsys, [*common, "--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix",
                          str(tmp_path / name)], match)
    assert _files(tmp_path) == sorted(f"{name}.jsonl" for name in cases)   # nothing written, no temporary file

    jsonl = str(tmp_path / "nokey.jsonl")
    _refused(capsys, [*common[:2], "--tokenizer", str(tok.dirs["plain"]), "--input", jsonl, "--output-prefix",
                      str(tmp_path / "x")],
             r"--tokenizer: got '.*plain'; has no chat template \(chat_template\.jinja, or chat_template in "
             r"tokenizer_config\.json\)")
    _refused(capsys, [*common, "--input", jsonl, "--output-prefix", str(tmp_path / "x"), "--json-keys", "text"],
             r"--json-keys: got \['text'\]; not used with --chat")
    _refused(capsys, ["preprocess", "--input", jsonl, "--tokenizer", str(tok.dirs["chatml"]), "--output-prefix",
                      str(tmp_path / "x"), "--chat-key", "m"], r"--chat-key: got 'm'; only with --chat")
    assert not list(tmp_path.glob("x*"))


def test_read_chat_dataset_refuses_a_mask_of_other_documents(tok, tmp_path):
    from moe_plugin.data import is_chat_dataset, read_chat_dataset

    common = ["preprocess", "--chat", "--tokenizer", str(tok.dirs["chatml"]), "--workers", "1", "--no-progress"]
    assert main([*common, "--input", str(_jsonl(tmp_path / "a.jsonl", CHATS)), "--output-prefix",
                 str(tmp_path / "a")]) == 0
    assert main([*common, "--input", str(_jsonl(tmp_path / "b.jsonl", CHATS[::-1])), "--output-prefix",
                 str(tmp_path / "b")]) == 0
    assert main([*common, "--input", str(_jsonl(tmp_path / "c.jsonl", CHATS[:2])), "--output-prefix",
                 str(tmp_path / "c")]) == 0
    read_chat_dataset(tmp_path / "a")
    for other, shown in (("b", "3 documents of other lengths"), ("c", "2 documents")):
        for ext in (".bin", ".idx"):
            (tmp_path / f"a_loss_mask{ext}").write_bytes((tmp_path / f"{other}_loss_mask{ext}").read_bytes())
        with pytest.raises(ConfigError, match=rf".*a_loss_mask\.idx: got {shown}; expected the documents of "
                                              rf".*a\.idx \(3, of the same lengths\): the loss mask belongs to other"):
            read_chat_dataset(tmp_path / "a")

    (tmp_path / "text.jsonl").write_text('{"text": "Paris."}\n')
    assert main(["preprocess", "--input", str(tmp_path / "text.jsonl"), "--tokenizer", str(tok.dirs["chatml"]),
                 "--output-prefix", str(tmp_path / "text"), "--workers", "1", "--no-progress"]) == 0
    assert not is_chat_dataset(tmp_path / "text") and not is_chat_dataset(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"text\.json: got format None; expected \"format\": \"chat\""):
        read_chat_dataset(tmp_path / "text")
    manifest = json.loads((tmp_path / "b.json").read_text())
    (tmp_path / "b.json").write_text(json.dumps(manifest | {"loss_mask": "../a_loss_mask"}))
    with pytest.raises(ConfigError, match=r"b\.json: got '\.\./a_loss_mask'; expected at \"loss_mask\" the name"):
        read_chat_dataset(tmp_path / "b")
