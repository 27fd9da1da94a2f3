"""The contract every tier passes. A new tier is a subclass with two methods:

    class TestMyTier(EvictingTierContract):
        def make_tier(self, capacity_chunks, chunk_bytes): ...   # a fresh, empty tier
        def corrupt(self, tier, key): ...                        # flip stored bytes of key

Stories, not unit checks: store a prompt, read it back, fill the tier past its size,
evict, corrupt, race.

``TierContract`` holds what every tier does. ``EvictingTierContract`` adds what a tier
that bounds itself does (a ``size``, least-recently-used eviction that takes a prompt's
tail before its head). A tier whose server bounds it (Redis: ``maxmemory`` and the
server's own eviction) passes ``TierContract`` and tests its bound against a real
server with a small ``maxmemory`` instead.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lmtier.errors import IntegrityError
from lmtier.kv.chunk import release_all
from lmtier.kv.layout import KVLayout
from lmtier.tiers.base import Tier

from conftest import SMALL, Prompt, make_namespace, make_prompt

CHUNK_BYTES = SMALL.chunk_bytes(16)


class TierContract:
    """Subclasses provide ``make_tier`` and ``corrupt``; the tests come from here."""

    def make_tier(self, capacity_chunks: int, chunk_bytes: int) -> Tier:
        raise NotImplementedError

    def corrupt(self, tier: Tier, key: bytes) -> None:
        raise NotImplementedError

    @pytest.fixture
    def tiers(self):
        made: list[Tier] = []

        def factory(capacity_chunks: int = 64, chunk_bytes: int = CHUNK_BYTES) -> Tier:
            made.append(self.make_tier(capacity_chunks, chunk_bytes))
            return made[-1]

        yield factory
        for tier in made:
            tier.close()

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def read_back(tier: Tier, prompt: Prompt) -> list[bytes | None]:
        """Each chunk's bytes, None for a miss or for a chunk that fails verification."""
        chunks = tier.get(prompt.keys)
        out: list[bytes | None] = []
        for chunk in chunks:
            try:
                out.append(None if chunk is None else chunk.tobytes())
            except IntegrityError:
                out.append(None)
        release_all(chunks)
        return out

    # -- round trips --------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    def test_round_trip_is_byte_identical(self, tiers, dtype):
        layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype)
        ns = make_namespace(layout=layout, chunk_tokens=8)
        tensor = torch.randn(layout.tensor_shape(32), generator=torch.Generator().manual_seed(1)).to(
            getattr(torch, dtype)
        )
        prompt = make_prompt(4, namespace=ns)
        prompt.kv = tensor.view(torch.uint8).numpy().reshape(layout.byte_shape(32))
        tier = tiers(chunk_bytes=ns.chunk_bytes)
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        try:
            for i, chunk in enumerate(got):
                assert chunk is not None
                assert chunk.layout == layout
                assert chunk.tobytes() == prompt.chunk_bytes(i)
                back = torch.from_numpy(np.ascontiguousarray(chunk.data)).view(getattr(torch, dtype))
                assert torch.equal(back.reshape(layout.tensor_shape(8)), tensor[:, :, i * 8 : (i + 1) * 8])
        finally:
            release_all(got)

    def test_get_answers_every_key_in_order(self, tiers, prompt):
        tier = tiers()
        tier.put(prompt.chunks(0, 3))
        other = make_prompt(2, seed=9)
        got = self.read_back(tier, prompt)
        assert got[:3] == [prompt.chunk_bytes(i) for i in range(3)]
        assert got[3:] == [None] * (len(prompt.keys) - 3)
        assert self.read_back(tier, other) == [None, None]

    def test_contains_counts_the_leading_run(self, tiers, prompt):
        tier = tiers()
        assert tier.contains(prompt.keys) == 0
        assert tier.contains([]) == 0
        tier.put(prompt.chunks(0, 5))
        assert tier.contains(prompt.keys) == 5
        assert tier.contains(prompt.keys[:3]) == 3
        gap = [*prompt.keys[:2], make_prompt(1, seed=5).keys[0], *prompt.keys[2:5]]
        assert tier.contains(gap) == 2
        assert tier.contains(prompt.keys[1:5]) == 4

    def test_putting_twice_stores_once(self, tiers, prompt):
        tier = tiers()
        tier.put(prompt.chunks())
        held = tier.stats()["chunks"]
        assert held == len(prompt.keys)
        tier.put(prompt.chunks())
        assert tier.stats()["chunks"] == held
        assert self.read_back(tier, prompt) == [prompt.chunk_bytes(i) for i in range(len(prompt.keys))]

    def test_delete_forgets_and_ignores_absent_keys(self, tiers, prompt):
        tier = tiers()
        tier.put(prompt.chunks())
        tier.delete([prompt.keys[3], make_prompt(1, seed=77).keys[0]])
        assert tier.contains(prompt.keys) == 3
        assert tier.get([prompt.keys[3]]) == [None]
        tier.delete(prompt.keys)
        assert tier.contains(prompt.keys) == 0
        assert tier.stats()["chunks"] == 0

    # -- integrity ------------------------------------------------------------------------
    def test_a_corrupted_chunk_is_a_miss_never_data(self, tiers, prompt):
        tier = tiers()
        tier.put(prompt.chunks())
        self.corrupt(tier, prompt.keys[2])
        got = self.read_back(tier, prompt)
        assert got[2] is None
        assert got[:2] == [prompt.chunk_bytes(0), prompt.chunk_bytes(1)]
        assert tier.contains(prompt.keys) == 2  # the bad copy is dropped
        assert tier.stats()["corrupt"] >= 1

    # -- concurrency ----------------------------------------------------------------------
    def test_concurrent_puts_and_gets_never_mix_bytes(self, tiers):
        tier = tiers(capacity_chunks=24)
        shared = make_prompt(3, seed=500)
        errors: list[str] = []

        def worker(wid: int) -> None:
            try:
                for step in range(15):
                    p = make_prompt(4, seed=wid * 1000 + step, shared_with=shared, shared_chunks=2)
                    tier.put(p.chunks())
                    for q in (p, shared):
                        got = tier.get(q.keys)
                        for i, chunk in enumerate(got):
                            if chunk is not None and chunk.tobytes() != q.chunk_bytes(i):
                                errors.append(f"worker {wid} step {step} chunk {i}: wrong bytes")
                        release_all(got)
            except Exception as exc:  # surfaced below
                errors.append(repr(exc))

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        stats = tier.stats()
        assert stats["capacity_bytes"] == 0 or stats["used_bytes"] <= stats["capacity_bytes"]


class EvictingTierContract(TierContract):
    """A tier that bounds itself: ``size``, and prefix-aware least-recently-used eviction."""

    def test_delete_returns_the_bytes(self, tiers, prompt):
        tier = tiers()
        tier.put(prompt.chunks())
        tier.delete(prompt.keys)
        assert tier.stats()["used_bytes"] == 0

    # -- capacity and eviction ----------------------------------------------------------
    def test_never_holds_more_than_its_size(self, tiers):
        tier = tiers(capacity_chunks=6)
        capacity = tier.stats()["capacity_bytes"]
        for seed in range(30):
            tier.put(make_prompt(3, seed=seed).chunks())
            stats = tier.stats()
            assert stats["used_bytes"] <= capacity
            assert stats["chunks"] * CHUNK_BYTES <= capacity
            assert stats["chunks"] <= 6
        last = make_prompt(3, seed=29)
        assert tier.contains(last.keys) == 3  # the newest prompt is always there

    def test_eviction_is_least_recently_used(self, tiers):
        tier = tiers(capacity_chunks=4)
        a, b, c = (make_prompt(2, seed=s) for s in (1, 2, 3))
        tier.put(a.chunks())
        tier.put(b.chunks())
        release_all(tier.get(a.keys))  # a is now more recent than b
        tier.put(c.chunks())
        assert tier.contains(a.keys) == 2
        assert tier.contains(b.keys) == 0
        assert tier.contains(c.keys) == 2

    def test_eviction_takes_a_prompts_tail_before_its_head(self, tiers):
        tier = tiers(capacity_chunks=6)
        a = make_prompt(4, seed=1)
        tier.put(a.chunks())
        release_all(tier.get(a.keys))  # read in prompt order: plain LRU would now evict a0 first
        tier.put(make_prompt(2, seed=2).chunks())
        tier.put(make_prompt(1, seed=3).chunks())  # one chunk must go: a's last one
        assert tier.contains(a.keys) == 3
        assert tier.get([a.keys[3]]) == [None]

    def test_chunks_held_under_pressure_stay_reachable_through_their_prefix(self, tiers):
        tier = tiers(capacity_chunks=12)
        rng = np.random.default_rng(7)
        roots = [make_prompt(6, seed=s) for s in range(3)]
        prompts = list(roots)
        for step in range(60):
            base = roots[rng.integers(len(roots))]
            shared = int(rng.integers(1, 5))
            p = make_prompt(int(rng.integers(shared + 1, 9)), seed=100 + step, shared_with=base, shared_chunks=shared)
            prompts.append(p)
            if rng.random() < 0.5:
                tier.put(p.chunks())
            else:
                q = prompts[rng.integers(len(prompts))]
                release_all(tier.get(q.keys[: tier.contains(q.keys)]))
            for q in prompts:
                held = [tier.has(k) for k in q.keys]
                run = tier.contains(q.keys)
                assert held == [True] * run + [False] * (len(q.keys) - run), f"step {step}: orphaned chunks"
