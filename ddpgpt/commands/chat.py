"""`ddpgpt chat`: a conversation with a model fine-tuned on conversations, in the chat template
it was trained on (data/chat.py; docs/chat.md).

    ddpgpt chat --run-dir runs/sft                     # at a terminal: type, Enter; Ctrl-D ends
    ddpgpt chat --run-dir runs/sft --system "Answer in one line." --temperature 0
    ddpgpt chat --init-from exported/sft               # an export, with its chat template
    printf 'What does json.dumps do?\\nAnd json.loads?\\n' | ddpgpt chat --run-dir runs/sft

Each turn renders the whole conversation so far by the template and asks for a reply after
<|assistant_start|>: the conversation is encoded once (one forward), then the reply is drawn
token by token with the KV cache (model/generate.py) and printed as it comes, until
<|assistant_end|> (or end-of-text) or --max-new-tokens. What the model is fed is exactly the ids
transformers' `apply_chat_template(messages, add_generation_prompt=True)` gives for an export of
it. A conversation that would leave less than --max-new-tokens of the context is cut: its oldest
exchanges dropped, the system message kept, said once. From a pipe (a script, a test) each line
is one user turn and each reply is printed on a line of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from ddpgpt.checkpoint.read import load_model
from ddpgpt.config.commands import ChatConfig
from ddpgpt.data import chat
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.distributed.group import resolve_device
from ddpgpt.errors import ChatError, say
from ddpgpt.model.generate import tokens
from ddpgpt.run.precision import Precision, flush_denormals, sampling_threads
from ddpgpt.run.run_dir import RunDir


def run(cfg: ChatConfig) -> None:
    device = resolve_device(cfg.device, 0)
    model, tok, autocast, where = load(cfg, device)
    if device.type == "cpu":
        flush_denormals()
    torch.set_num_threads(cfg.threads or sampling_threads(model.num_params(False)))
    talk = Talk(model, tok, cfg, autocast, device)
    interactive = sys.stdin.isatty()
    if interactive:
        say(f"ddpgpt chat: {where}; type a message and Enter, Ctrl-D to end")
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    for line in _lines(interactive):
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = ""
        for piece in talk.reply(messages):
            print(piece, end="", flush=True)
            reply += piece
        print(flush=True)
        messages = talk.kept + [{"role": "assistant", "content": reply or " "}]


def _lines(interactive: bool) -> Iterator[str]:
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def load(cfg: ChatConfig, device: torch.device):
    """(the model in eval mode, its tokenizer, the autocast to run it in, what it is) of a run's
    checkpoint or of an export; one line when its tokenizer has no chat template."""
    if cfg.init_from:
        from ddpgpt.hf.pretrained import load as load_export
        from ddpgpt.hf.pretrained import model_of
        found = load_export(cfg.init_from)
        model, tok, autocast = model_of(found, device), found.tokenizer, None
        where, fix = f"--init-from {cfg.init_from}", "fine-tune the run it came from"
    else:
        run_dir = RunDir(cfg.run_dir)
        model, found = load_model(run_dir, device, cfg.step)
        tok = load_tokenizer(run_dir.path, run_dir.read_data_meta("chat needs")["tokenizer"])
        autocast = Precision.for_inference(found.config.run, device).autocast
        where = f"run {run_dir} (step {found.step})"
        fix = (f"fine-tune it: ddpgpt prepare CHATS.jsonl --chat --tokenizer-from {run_dir} --out "
               f"data/chat, then ddpgpt train --data data/chat --init-from {run_dir}")
    missing = chat.missing(tok.special)
    if missing:
        raise ChatError(f"{where}: its tokenizer has no {missing[0]} (no chat template): the "
                        f"model was not fine-tuned on conversations; {fix}")
    return model, tok, autocast, where


class Talk:
    """A model's side of a conversation: `reply(messages)` streams its next turn."""

    def __init__(self, model, tok, cfg: ChatConfig, autocast, device: torch.device):
        self.model, self.tok, self.cfg, self.device = model, tok, cfg, device
        self.autocast = autocast
        self.gen = torch.Generator(device=device).manual_seed(cfg.seed)
        self.stops = {tok.special["<|assistant_end|>"], tok.eot_id}
        self.room = max(1, model.cfg.block_size - cfg.max_new_tokens)
        self.cut = False  # the conversation has outgrown the context once (said then)
        self.kept: list[dict] = []

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids the reply to `messages` is drawn after (its oldest turns dropped when they do
        not fit the room a reply leaves)."""
        self.kept, ids, dropped = chat.fit(messages, self.tok.encode_batch, self.tok.special,
                                           self.tok.eot_id, self.room)
        if dropped and not self.cut:
            self.cut = True
            say(f"ddpgpt chat: the conversation outgrew the model's context ({self.room} tokens "
                f"and {self.cfg.max_new_tokens} for a reply): its oldest turns are dropped from "
                "here on")
        return ids.tolist()

    def reply(self, messages: list[dict]) -> Iterator[str]:
        """The reply's text, piece by piece as its tokens are drawn (a piece that would end in
        the middle of a character waits for the rest of it)."""
        ids = torch.tensor([self.prompt(messages)], dtype=torch.long, device=self.device)
        drawn, said = [], ""
        with self.autocast() if self.autocast else torch.no_grad():
            for nxt in tokens(self.model, ids, self.cfg.max_new_tokens, self.cfg.temperature,
                              self.cfg.top_k or None, self.gen, self.tok.vocab_size):
                token = int(nxt.item())
                if token in self.stops:
                    break
                drawn.append(token)
                text = self.tok.decode(drawn)
                if not text.endswith("\ufffd"):
                    yield text[len(said):]
                    said = text
        self.drawn = drawn  # the reply's ids (a test compares them with transformers')
        if self.tok.decode(drawn) != said:  # a character cut short at the end: as it is
            yield self.tok.decode(drawn)[len(said):]
