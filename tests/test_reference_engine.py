"""The reference engine's schedulers against the single-process oracle, in one process.

The KV pages travel through an in-process page copy that honours the same engine-side contract
as the messenger (per-layer progress, chunk boundaries, hidden state after the last chunk); the
multi-process tests through the real messenger are in test_reference_serve.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdtool.engines.reference.cache import PageAllocator, PagedKV
from pdtool.engines.reference.engine import Coord, DecodeEngine, PrefillEngine
from pdtool.engines.reference.model import Batch, TinyConfig, TinyModel
from pdtool.engines.reference.oracle import encode, generate

torch.set_num_threads(1)
PAGE = 4


class CopyLink:
    """Prefill and decode sides of an in-process page copy (TP1 → TP1)."""

    def __init__(self, pre: PagedKV, dec: PagedKV) -> None:
        self.pre, self.dec = pre, dec
        self.inbox: list[dict] = []
        self.dst: dict[str, list[int]] = {}
        self.src: dict[str, list[int]] = {}
        self.src_tokens: dict[str, list[int]] = {}
        self.chunks: list[tuple[str, int, int]] = []
        self.hiddens: dict[str, torch.Tensor] = {}
        self.sent: set[str] = set()
        self.refused: dict[str, str] = {}
        self.pages_copied = 0

    # decode side
    def submit(self, rid, tokens, pages, peer):
        self.dst[rid] = pages
        self.inbox.append({"rid": rid, "tokens": tokens})

    def ready(self):
        return set(self.hiddens)

    def failed(self):
        return set()

    def hidden(self, rid):
        return self.hiddens[rid]

    def release(self, rid):
        self.hiddens.pop(rid)

    # prefill side
    def recv(self):
        out, self.inbox = self.inbox, []
        return out

    def accept(self, req, pages):
        self.src[req["rid"]] = pages
        self.src_tokens[req["rid"]] = req["tokens"]

    def refuse(self, req, reason):
        self.refused[req["rid"]] = reason

    def begin(self, chunks):
        for rid, lo, hi in chunks:  # the messenger's rule: whole pages except the prompt's end
            todo = len(self.src_tokens[rid]) - 1
            assert lo % PAGE == 0 and 0 <= lo < hi <= todo and (hi % PAGE == 0 or hi == todo)
        self.chunks = chunks

    def layer_done(self, layer):
        for rid, lo, hi in self.chunks:
            first, last = lo // PAGE, -(-hi // PAGE)
            s = torch.tensor(self.src[rid][first:last])
            d = torch.tensor(self.dst[rid][first:last])
            self.dec.layers[layer][d] = self.pre.layers[layer][s]
            self.pages_copied += len(s)

    def finish(self, rid, hidden):
        self.hiddens[rid] = hidden
        self.sent.add(rid)

    def done(self):
        return set(self.sent)


class PrefillSide:
    """The prefill engine's view of a CopyLink (its own `release`)."""

    def __init__(self, link: CopyLink) -> None:
        self.link = link

    def __getattr__(self, name):
        return getattr(self.link, name)

    def release(self, rid):
        self.link.sent.discard(rid)


class Pair:
    def __init__(self, cfg: TinyConfig, chunk: int = 8, pages: int = 256, faults=None):
        self.faults = faults
        self.pkv = PagedKV(cfg, cfg.cache_heads, pages, PAGE)
        self.dkv = PagedKV(cfg, cfg.cache_heads, pages, PAGE)
        self.link = CopyLink(self.pkv, self.dkv)
        self.pre = PrefillEngine(TinyModel(cfg), self.pkv, PrefillSide(self.link), Coord(), chunk)
        self.dec = DecodeEngine(TinyModel(cfg), self.dkv, self.link, Coord())

    def run(self, prompts: list[list[int]], max_tokens: int, stagger: int = 0):
        """Feed requests (one new every `stagger` steps, 0: all at once); collect outputs."""
        outs: dict[str, list[int]] = {}
        infos: dict[str, dict] = {}
        pending = [
            {"rid": f"r{i}", "tokens": p, "max_tokens": max_tokens, "peer": 0,
             "faults": self.faults}
            for i, p in enumerate(prompts)
        ]
        step = 0
        while pending or self.dec.busy or self.pre.busy:
            new = []
            if pending and (stagger == 0 or step % stagger == 0):
                new = pending if stagger == 0 else pending[:1]
                pending = pending[len(new) :]
            for ev in self.dec.step(new):
                outs.setdefault(ev.rid, []).extend(ev.tokens)
                if ev.done:
                    infos[ev.rid] = ev.info
            self.pre.step(self.link.recv())
            step += 1
            assert step < 10_000
        return [outs[f"r{i}"] for i in range(len(prompts))], [
            infos[f"r{i}"] for i in range(len(prompts))
        ]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "KV", "page", "decode", "prefill", "σ", "ünï", "42", "\n"]
    return [encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))) for _ in
            range(n)]


def test_allocator_counts_and_rejects_double_free():
    a = PageAllocator(8)
    p = a.alloc(5)
    assert a.num_free == 3 and len(set(p)) == 5
    a.free(p[:2])
    assert a.num_free == 5
    with pytest.raises(ValueError, match="freed twice"):
        a.free(p[:1])


def test_allocator_hands_out_the_lowest_free_pages_in_ascending_order():
    # what two requests of one size in a row got from a LIFO free list: the second one's
    # pages in descending order, which the CPU attention gathered at less than half the speed
    a = PageAllocator(16)
    first = a.alloc(6)
    assert first == [0, 1, 2, 3, 4, 5]
    a.free(first)
    assert a.alloc(6) == first
    assert a.alloc(4) == [6, 7, 8, 9]
    a.free([9, 4, 1, 7])
    assert a.alloc(3) == [1, 4, 7]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_disaggregated_schedulers_match_oracle(attention):
    cfg = TinyConfig(attention=attention)
    prompts = [*_prompts(12, seed=1), [65], [65, 66]]  # includes 1- and 2-token prompts
    pair = Pair(cfg, chunk=8)
    outs, _ = pair.run(prompts, max_tokens=6, stagger=1)
    ref = TinyModel(cfg)
    for p, o in zip(prompts, outs, strict=True):
        assert o == generate(cfg, p, 6, ref)
    # the decoder saw one prompt token per request: the prompt arrived as pages
    assert pair.dec.prompt_tokens_seen == len(prompts)
    gen = sum(len(o) for o in outs)
    assert pair.dec.model.tokens_seen <= len(prompts) + gen + len(prompts)  # + drafts
    assert pair.pkv.pages.num_free == pair.pkv.pages.num_pages
    assert pair.dkv.pages.num_free == pair.dkv.pages.num_pages


def test_damaged_page_changes_output_damaged_hidden_changes_only_the_draft():
    cfg = TinyConfig()
    prompts = _prompts(6, seed=3)
    prompts = [p + encode(" and some more text") for p in prompts]
    clean, info = Pair(cfg).run(prompts, 8)
    broken, _ = Pair(cfg, faults={"page": (0, 0)}).run(prompts, 8)
    assert sum(a != b for a, b in zip(clean, broken, strict=True)) >= len(prompts) // 2
    moved, minfo = Pair(cfg, faults={"hidden": True}).run(prompts, 8)
    assert moved == clean  # verified drafts never change the text...
    drafts = [i["draft"] for i in info]
    assert sum(a != b["draft"] for a, b in zip(drafts, minfo, strict=True)) >= len(prompts) // 2


def test_requests_larger_than_the_cache_fail_alone():
    cfg = TinyConfig()
    pair = Pair(cfg, pages=16)  # 64 tokens of cache on each side
    big, small = encode("x" * 70), encode("small prompt")
    outs, infos = pair.run([big, small], 4)
    assert outs[0] == [] and "pages" in infos[0]["error"]
    assert outs[1] == generate(cfg, small, 4)
    assert pair.dkv.pages.num_free == pair.pkv.pages.num_free == 16


class TwoRanks(Coord):
    """This rank plus a scripted second rank whose polls say `other_failed` failed there."""

    def __init__(self, other_failed: set[str]) -> None:
        super().__init__(size=1)
        self.other_failed = other_failed

    def gather(self, *polls):
        fails, oks = polls
        return [[set(fails), fails | (self.other_failed & (fails | oks))],
                [set(oks), oks - self.other_failed]]


def test_a_transfer_that_failed_on_any_rank_fails_once_every_rank_settled():
    cfg = TinyConfig()
    pair = Pair(cfg)
    pair.dec.coord = TwoRanks({"r0"})  # r0 arrived here but failed on the other decode rank
    outs, infos = pair.run([encode("first prompt"), encode("second prompt")], 4)
    assert outs[0] == [] and infos[0]["error"] == "KV transfer failed"
    assert outs[1] == generate(cfg, encode("second prompt"), 4)
    assert pair.dec.prompt_tokens_seen == 1  # r0 never ran
    assert pair.dkv.pages.num_free == pair.dkv.pages.num_pages


@pytest.mark.parametrize(("attention", "page_size"), [("gqa", 1), ("gqa", 16), ("mla", 4)])
def test_attention_reads_scattered_pages_like_contiguous_ones(attention, page_size):
    """The page table is the only thing tying tokens to memory: scattered page ids and other
    page sizes give the same tokens as the oracle's contiguous pages."""
    cfg = TinyConfig(attention=attention)
    model = TinyModel(cfg)
    prompt = encode("paged attention gathers by page id")
    want = generate(cfg, prompt, 6, model)
    kv = PagedKV(cfg, cfg.cache_heads, 256, page_size)
    kv.pages.alloc(7)  # used by someone else
    pages = kv.pages.alloc(-(-(len(prompt) + 6) // page_size))
    random.Random(0).shuffle(pages)
    out, run, start = [], prompt, 0
    for _ in range(6):
        hidden = model.forward(Batch.build([(run, start, pages)], page_size), kv.layers,
                               page_size)
        out.append(int(model.logits(hidden[-1:]).argmax(-1)))
        start += len(run)
        run = out[-1:]
    assert out == want


def test_health_reports_a_messenger_that_cannot_take_work():
    """/health is 503 "starting" until ready, 200 while the messenger can take work, and 503
    with the messenger's reason while it cannot (e.g. its thread stuck inside the provider)."""
    import json
    import urllib.error
    import urllib.request

    from pdtool.engines.reference.health import HealthServer

    reason = [""]
    srv = HealthServer("127.0.0.1", 0, lambda: {"role": "decode"}, lambda: {},
                       lambda: reason[0])

    def get() -> tuple[int, dict]:
        url = f"http://127.0.0.1:{srv.httpd.server_address[1]}/health"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        assert get() == (503, {"status": "starting"})
        srv.ready = True
        assert get() == (200, {"status": "ok", "role": "decode"})
        reason[0] = "decode messenger thread stuck for 12.0 s in one call"
        assert get() == (503, {"status": "unhealthy", "reason": reason[0]})
    finally:
        srv.close()


def test_a_token_outside_the_vocabulary_fails_only_its_request():
    """The front checks ids against its tokenizer; the decoder checks them against the model's
    embedding rows, so a tokenizer with more ids than the model never crashes an instance."""
    from pdtool.engines.reference.engine import AggregatedEngine

    cfg = TinyConfig()
    kv = PagedKV(cfg, cfg.cache_heads, 64, PAGE)
    engine = AggregatedEngine(TinyModel(cfg), kv, Coord(), 8)
    # as the serving loop builds them (serve._take_requests): every field, peer 0 there
    events = engine.step([{"rid": "bad", "tokens": [1, 9999], "max_tokens": 2, "peer": 0},
                          {"rid": "good", "tokens": encode("fine"), "max_tokens": 3,
                           "peer": 0}])
    assert [(e.rid, e.done) for e in events] == [("bad", True)]
    assert "outside the model" in events[0].info["error"]
    out = []
    while engine.busy:
        out += [t for e in engine.step() if e.rid == "good" for t in e.tokens]
    assert out == generate(cfg, encode("fine"), 3)
    assert kv.pages.num_free == kv.pages.num_pages
