"""Chat: templates rendered with jinja2 alone give exactly transformers' apply_chat_template
(text and token ids), Model.chat decodes exactly what plain decoding of those ids does, and
the CLI's ``generate --chat`` and ``chat`` REPL work end to end, with one-line errors."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgemtp.chat import ChatTemplate, check_messages
from edgemtp.errors import ConfigError
from edgemtp.tokenizer import Tokenizer

from conftest import STORIES, smollm2_dir

SMOLLM_GGUF = smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML as SmolLM2/Qwen write it, spread over lines so trim_blocks/lstrip_blocks matter, with
# the BOS variable, loop controls, tojson and raise_exception
CHATML = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
    {% if message.get('name') %}{{ message['name'] | tojson }}{% continue %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Once upon a time there was a dog."}],
    [{"role": "system", "content": "You tell short stories."},
     {"role": "user", "content": "Tell me about a cat."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, friend."},
     {"role": "user", "content": "  What next?\n"}],
    [{"role": "user", "content": "Grüße, 猫 and émojis 🐈 <b>&</b>", "name": "Zoë \"<x>\""}],
]


def make_chat_model(folder: Path, template: str | list = CHATML, as_file: bool = False) -> Path:
    """stories260K's config and tokenizer files (weights symlinked) with a chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in STORIES.iterdir():
        if f.name == "model.safetensors":
            (folder / f.name).symlink_to(f)
        elif f.suffix in (".json", ".model"):
            shutil.copy(f, folder / f.name)
            (folder / f.name).chmod(0o644)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if as_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat") / "stories-chat")


@pytest.fixture(scope="module")
def model(chat_model):
    from edgemtp import Model

    return Model.load(str(chat_model), threads=1)


def _hf_apply(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return text, list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("form", ["string", "named-list", "jinja-file"])
def test_text_and_ids_equal_transformers_apply_chat_template(tmp_path, form):
    from transformers import AutoTokenizer

    template = [{"name": "default", "template": CHATML}] if form == "named-list" else CHATML
    folder = make_chat_model(tmp_path / form, template, as_file=form == "jinja-file")
    hf, ours = AutoTokenizer.from_pretrained(folder), Tokenizer(str(folder))
    for messages in CONVERSATIONS:
        text, ids = _hf_apply(hf, messages)
        assert ours.chat_template.render(messages) == text
        assert ours.encode_chat(messages) == ids
        assert ids[0] == hf.bos_token_id and ids.count(hf.bos_token_id) == 1  # BOS once


def test_special_tokens_map_wins_over_tokenizer_config_as_in_transformers(tmp_path):
    """qa10a C4: which file wins where tokenizer_config.json and the legacy
    special_tokens_map.json name different special tokens was never tested, and edgemtp took
    the config's: transformers takes the map's, so a template that prints them read other
    text than apply_chat_template. (An exported package writes transformers' merge.)"""
    from transformers import AutoTokenizer

    folder = make_chat_model(tmp_path / "both", "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}"
                             "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config.get("eos_token") and config.get("bos_token")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<map-eos>", "bos_token": "<map-bos>", "unk_token": "<map-unk>"}))
    messages = [{"role": "user", "content": "Hi"}]
    text, _ = _hf_apply(AutoTokenizer.from_pretrained(folder), messages)
    assert Tokenizer(str(folder)).chat_template.render(messages) == text
    assert text.startswith("<map-bos>|<map-eos>|<map-unk>")


def test_real_smollm2_template_from_gguf_matches_transformers():
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(SMOLLM_GGUF.parent), gguf_file=SMOLLM_GGUF.name)
    ours = ChatTemplate(hf.chat_template, hf.special_tokens_map)
    for messages in CONVERSATIONS:
        text, ids = _hf_apply(hf, messages)
        assert ours.render(messages) == text
        assert hf(ours.render(messages), add_special_tokens=False).input_ids == ids


def test_chat_equals_plain_decoding_of_the_templated_ids(model):
    for messages in CONVERSATIONS[:3]:
        ids = model.encode_chat(messages)
        plain = model.generate(ids, max_new_tokens=40, drafter="none")
        probed = model.chat(messages, max_new_tokens=40, bc=30, drafter="probe")
        assert probed.token_ids == plain.token_ids
        assert probed.text == plain.text and probed.text
        assert "".join(model.chat_stream(messages, max_new_tokens=40)) == plain.text


BAD_MESSAGES = [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], "message 0 must be a dict with 'role' and 'content'"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 must be a dict"),
    ([{"role": "user", "content": ["a"]}],
     "message 0's content part 0 must be {'type': 'text', 'text': str} .text only., got 'a'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "message 0's content part 0 must be"),
    ([{"role": "user", "content": 5}], "message 0's content must be a string or a list of"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udce9"}]}],
     "message 0's content is not valid UTF-8 text"),
    ([{"role": 7, "content": "a"}], "message 0's role must be a non-empty string"),
    ([{"role": "", "content": "a"}], "message 0's role must be a non-empty string"),
    # lone surrogates: what Python makes of bytes that were not UTF-8 (argv, stdin, JSON)
    ([{"role": "user", "content": "Hi \udce9t\udce9"}],
     "message 0's content is not valid UTF-8 text .an undecodable byte at character 3"),
    ([{"role": "user", "content": "a"}, {"role": "\ud800", "content": "b"}],
     "message 1's role is not valid UTF-8 text"),
]


def test_openai_text_parts_are_the_joined_string(model):
    """QA (qa8a D7): model.chat() refused the content parts the server takes, so the messages
    an app sends to OpenAI's API could not go to the Python API as they are."""
    parts = [{"role": "system", "content": [{"type": "text", "text": "Tell a "},
                                            {"type": "text", "text": "story."}]},
             {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}]
    flat = [{"role": "system", "content": "Tell a story."},
            {"role": "user", "content": "Once upon a time"}]
    assert check_messages(parts) == flat and parts[0]["content"][0]["text"] == "Tell a "
    assert model.encode_chat(parts) == model.encode_chat(flat)
    assert model.chat(parts, max_new_tokens=8).token_ids == model.chat(
        flat, max_new_tokens=8).token_ids


@pytest.mark.parametrize("messages,expected", BAD_MESSAGES)
def test_bad_messages_are_one_line_config_errors(messages, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")) as e:
        check_messages(messages)
    assert "\n" not in str(e.value)


def test_template_raise_exception_and_missing_template_are_config_errors(model, stories_path):
    from edgemtp import Model

    with pytest.raises(ConfigError, match="chat template rejected the messages: unknown role robot"):
        model.chat([{"role": "robot", "content": "beep"}])
    with pytest.raises(ConfigError, match="has no chat template"):
        Model.load(stories_path, threads=1).chat([{"role": "user", "content": "hi"}])


def _cli(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_chat_with_system_through_the_cli(model, chat_model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Once upon a time"}]
    out = _cli("generate", "--model", str(chat_model), "--chat", "--system", "Be brief.",
               "--prompt", "Once upon a time", "--max-new-tokens", "24", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == model.chat(messages, max_new_tokens=24).token_ids


def test_chat_repl_keeps_history_resets_and_exits(model, chat_model):
    first = [{"role": "user", "content": "Tell me a story."}]
    a1 = model.chat(first, max_new_tokens=16).text
    second = first + [{"role": "assistant", "content": a1},
                      {"role": "user", "content": "And then?"}]
    a2 = model.chat(second, max_new_tokens=16).text
    fresh = model.chat([{"role": "user", "content": "And then?"}], max_new_tokens=16).text
    slash = model.chat([{"role": "user", "content": "/etc"}], max_new_tokens=16).text
    # (qa8b D2: /help, /quit and an unknown /foo went to the model as user turns)
    out = _cli("chat", str(chat_model), "--max-new-tokens", "16",
               stdin="Tell me a story.\n/help\n/foo bar\nAnd then?\n/clear\nAnd then?\n"
                     "/reset\n//etc\n/quit\nignored\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{a1}\n{a2}\n{fresh}\n{slash}\n"
    stats = [line for line in out.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 7 and stats[3] == stats[5] == "[history cleared]", stats
    assert stats[1].startswith("[unknown command '/foo': nothing was sent; /help lists")
    assert "  /reset  (/clear) forget the conversation" in out.stderr
    assert "/exit   (/quit, /bye) quit" in out.stderr


def test_ctrl_c_in_a_chat_answer_stops_that_answer_only(model, capsys):
    """qa8b D1: a Ctrl-C while chat answered ended the session (exit 130, the conversation
    lost); llama-cli and ollama stop the answer and go back to the prompt."""
    from edgemtp import cli

    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = model.chat(messages, max_new_tokens=32, drafter="none")
    class Interrupted:  # the real stream, with a Ctrl-C after its third piece
        def __init__(self):
            self.stream = model.chat_stream(messages, max_new_tokens=32, drafter="none")

        def __iter__(self):
            for i, piece in enumerate(self.stream):
                if i == 3:
                    raise KeyboardInterrupt
                yield piece

        def close(self):
            self.stream.close()

    model.release_sessions()
    text = cli._print_stream(model, Interrupted(), stoppable=True)
    assert text and whole.text.startswith(text) and len(text) < len(whole.text)
    assert len(model._idle) == 1 and model._idle[0].cache_len == 0  # the cache came back
    err = capsys.readouterr().err
    assert err.strip() == "[stopped: Ctrl-C; the answer so far stays in the conversation]"
    with pytest.raises(KeyboardInterrupt):  # generate's stream is not stoppable
        cli._print_stream(model, Interrupted())


@pytest.mark.slow  # (~10-16 s of the default run; CI runs the slow set)
def test_a_chat_longer_than_the_context_drops_its_oldest_exchanges(chat_model):
    """The REPL keeps going where the conversation outgrows the context: the oldest exchanges
    go (the system message stays) until there is room for an answer, and it says so. Each
    answer equals the Python API's chat on the history that was kept."""
    from edgemtp import Model

    ctx, new = 96, 12
    small = Model.load(str(chat_model), threads=1, max_context=ctx)
    system = {"role": "system", "content": "Be brief."}
    lines = ["Tell me a story about a dog.", "What happened next?", "And the cat?",
             "Where did they go?", "How did it end?"]
    history, want, drops = [], [], 0
    for line in lines:  # the policy written out: room for min(new, ctx // 4) tokens
        turn = {"role": "user", "content": line}
        room = min(new, ctx // 4)
        while history and len(small.encode_chat([system, *history, turn])) + room > ctx:
            history, drops = history[2:], drops + 1
        answer = small.chat([system, *history, turn], max_new_tokens=new).text
        want.append(answer)
        history += [turn, {"role": "assistant", "content": answer}]
    assert drops >= 2, "the test's conversation must outgrow the context"
    out = _cli("chat", str(chat_model), "--system", "Be brief.", "--max-context", str(ctx),
               "--max-new-tokens", str(new), stdin="\n".join(lines) + "\n")
    assert out.returncode == 0, out.stderr
    assert "error" not in out.stderr, out.stderr
    assert out.stdout == "".join(f"{a}\n" for a in want)
    said = re.findall(r"\[dropped the (\d+) oldest exchanges? to fit the context of 96 tokens\]",
                      out.stderr)
    assert sum(map(int, said)) == drops, out.stderr


@pytest.mark.slow  # (~10-16 s of the default run; CI runs the slow set)
def test_cli_chat_keeps_the_history_when_a_turn_cannot_run(chat_model):
    """QA (qa6 context, 1): a turn longer than the context made the REPL drop every earlier
    exchange (and say so) before the error, so the next answer lost them. Now the error
    says the turn cannot run, and the next turn sees the whole conversation."""
    from edgemtp import Model

    ctx, new = 320, 8
    small = Model.load(str(chat_model), threads=1, max_context=ctx)
    first = {"role": "user", "content": "Tell me a story about a dog."}
    answer = small.chat([first], max_new_tokens=new).text
    then = {"role": "user", "content": "And the cat?"}
    want = small.chat([first, {"role": "assistant", "content": answer}, then],
                      max_new_tokens=new).text
    long = "dog " * 400
    out = _cli("chat", str(chat_model), "--max-context", str(ctx), "--max-new-tokens", str(new),
               stdin="\n".join([first["content"], long, then["content"]]) + "\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{answer}\n{want}\n"
    assert "dropped" not in out.stderr
    assert re.search(r"edgemtp: error: this turn takes \d+ tokens; the context is 320 tokens, "
                     r"which leaves no room to answer; the conversation so far \(2 messages\) "
                     r"is kept", out.stderr), out.stderr


@pytest.mark.parametrize("args,expected", [
    (("generate", "--model", str(STORIES), "--chat", "--prompt", "hi"), "has no chat template"),
    (("chat", str(STORIES)), "has no chat template"),
    (("generate", "--model", str(STORIES), "--system", "x", "--prompt", "hi"),
     "--system is a chat option; add --chat"),
])
def test_cli_chat_errors_are_one_line_exit_2(args, expected):
    out = _cli(*args, stdin="hi\n")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("edgemtp: error:") and expected in out.stderr
    assert out.stderr.count("\n") == 1


def test_an_exported_package_carries_the_template(chat_model, model, tmp_path):
    pytest.importorskip("onnx")
    from edgemtp import Model
    from edgemtp.export.onnx_export import export_package

    export_package(str(chat_model), tmp_path / "pkg", max_context=256, bc=(30,),
                   mask_tokens=(1,), progress=False)
    pkg = Model.load(str(tmp_path / "pkg"), threads=1)
    for messages in CONVERSATIONS:
        assert pkg.encode_chat(messages) == model.encode_chat(messages)
    out = _cli("inspect", str(tmp_path / "pkg"))
    assert out.returncode == 0 and "\nchat      chat template (generate --chat" in out.stdout
    # a template that is not Jinja: plain prompts still run, so inspect says so and passes
    broken = make_chat_model(tmp_path / "broken", "{% for m in messages %}{{ m.content }")
    export_package(str(broken), tmp_path / "pkg-broken", max_context=64, bc=(10,),
                   mask_tokens=(1,), progress=False)
    out = _cli("inspect", str(tmp_path / "pkg-broken"))
    assert out.returncode == 0, out.stderr
    assert ("\nchat      the chat template is broken: the model's chat template is not valid "
            "Jinja (line 1: ") in out.stdout


@pytest.mark.slow  # a REPL in a subprocess (~10 s of the default run): CI only
def test_the_chat_repl_answers_a_line_of_bad_bytes_with_an_error_and_goes_on(model, chat_model):
    # (undecodable bytes reached the tokenizer as lone surrogates: a TypeError ended the REPL)
    want = model.chat([{"role": "user", "content": "Tell me a story."}], max_new_tokens=8).text
    out = subprocess.run([sys.executable, "-m", "edgemtp.cli", "chat", str(chat_model),
                          "--max-new-tokens", "8"], input=b"Hi \xe9t\xe9\nTell me a story.\n",
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert out.stdout.decode() == f"{want}\n"
    assert b"this line is not valid UTF-8 text" in out.stderr  # (qa8b D9: "message 0's")


def test_bench_sends_spec_bench_questions_as_one_user_turn(model, stories_path):
    from edgemtp import Model
    from edgemtp.tools.prompts import chat_turns

    tasks = {"stories": ["Once upon a time"], "coding": ["Write a loop.", "Sort a list."]}
    turns = chat_turns(model, tasks)
    assert turns["stories"] == tasks["stories"]
    assert turns["coding"] == [model.encode_chat([{"role": "user", "content": q}])
                               for q in tasks["coding"]]
    assert chat_turns(Model.load(stories_path, threads=1), tasks) == tasks  # no template
