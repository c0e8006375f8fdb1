"""Random image ops seeded with an int (``seed=42``, what a tf.data user writes) inside a
pipeline: the augmentation of an element depends on the element, never on who ran it.

The generator draws pipelines (a source of images, with or without labels; shuffle,
skip, take, shard or repeat below or above the map; a batch after it) and one of the
int-seeded augmentations of ``image_fns``. The oracle is the same pipeline with a
sequential map: run with 1 and 2 threads, on 2 worker processes, and restored from a
checkpoint taken at a random element, it must give the very same outputs.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import image_fns
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
import headrace.image as hi
from headrace.image._random import seed_generator

SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _pipeline(case: dict[str, Any], **map_args: Any) -> hr.Dataset:
    rng = np.random.default_rng(case["seed"])
    images = rng.integers(0, 256, (case["count"], 9, 8, 3)).astype(np.uint8)
    ds = hr.Dataset.from_tensor_slices(images)
    for stage in case["below"]:
        ds = _stage(ds, stage)
    ds = ds.map(image_fns.SEEDED_AUGMENTATIONS[case["fn"]], **map_args)
    for stage in case["above"]:
        ds = _stage(ds, stage)
    return ds


def _stage(ds: hr.Dataset, stage: str) -> hr.Dataset:
    if stage == "shuffle":
        return ds.shuffle(7, seed=3)
    if stage == "skip":
        return ds.skip(2)
    if stage == "take":
        return ds.take(30)
    if stage == "shard":
        return ds.shard(2, 1)
    if stage == "repeat":
        return ds.repeat(2)
    assert stage == "batch"
    return ds.batch(3, drop_remainder=True)  # (a batch of batches needs equal sizes)


def _outputs(ds: hr.Dataset, restore_at: int | None = None) -> list[np.ndarray]:
    outputs: list[np.ndarray] = []
    with iter(ds) as iterator:
        for element in iterator:
            outputs.append(np.asarray(element))
            if restore_at is not None and len(outputs) == restore_at:
                break
        else:
            return outputs
        state = iterator.get_state()
    with iter(ds) as resumed:
        resumed.set_state(state)
        outputs.extend(np.asarray(element) for element in resumed)
    return outputs


def _same(got: list[np.ndarray], expected: list[np.ndarray], how: str) -> None:
    assert len(got) == len(expected), how
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert np.array_equal(a, b), f"{how}: element {index} differs"


cases = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "count": st.integers(8, 40),
    "fn": st.sampled_from(sorted(image_fns.SEEDED_AUGMENTATIONS)),
    "below": st.lists(st.sampled_from(["shuffle", "skip", "take", "shard", "repeat"]),
                      max_size=2),
    "above": st.lists(st.sampled_from(["shuffle", "skip", "take", "repeat", "batch"]),
                      max_size=2),
})


@SETTINGS
@given(case=cases, restore=st.integers(1, 30))
def test_int_seeded_ops_give_each_element_its_augmentation_whoever_runs_it(
    case: dict[str, Any], restore: int
) -> None:
    expected = _outputs(_pipeline(case))
    for map_args in ({"num_parallel_calls": 1}, {"num_parallel_calls": 2}):
        _same(_outputs(_pipeline(case, **map_args)), expected, f"{map_args}")
    _same(_outputs(_pipeline(case, num_parallel_calls=2), restore % (len(expected) + 1) or None),
          expected, "threads, restored")
    _same(_outputs(_pipeline(case), restore % (len(expected) + 1) or None), expected,
          "sequential, restored")


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases, restore=st.integers(1, 30))
def test_int_seeded_ops_on_worker_processes_match_the_sequential_map(
    case: dict[str, Any], restore: int
) -> None:
    expected = _outputs(_pipeline(case))
    processes = {"num_parallel_calls": 2, "workers": "processes"}
    _same(_outputs(_pipeline(case, **processes)), expected, "processes")
    _same(_outputs(_pipeline(case, **processes), restore % (len(expected) + 1) or None),
          expected, "processes, restored")


def test_each_epoch_and_element_draws_anew_and_an_iteration_draws_the_same() -> None:
    """What a training loop needs: another augmentation per element and per epoch (not one
    draw for all), the same again when the dataset is iterated again (tf.data's rule for
    seeded ops), and ``seed=s`` at element ``i`` is the explicit pair ``(s, i)``."""
    images = np.random.default_rng(0).integers(0, 256, (64, 6, 6, 3)).astype(np.uint8)
    ds = hr.Dataset.from_tensor_slices(images).map(image_fns.flip_crop).repeat(2)
    first, again = [np.stack(list(ds)) for _ in range(2)]
    assert np.array_equal(first, again)
    assert not np.array_equal(first[:64], first[64:])  # epochs differ
    crops = {hi.random_crop(np.arange(81).reshape(9, 9, 1), (5, 5, 1), seed=(44, i))[0, 0, 0]
             for i in range(64)}
    assert len(crops) > 5  # elements differ
    explicit = [hi.random_flip_left_right(image, seed=(5, i)) for i, image in enumerate(images)]
    labelled = hr.Dataset.from_tensor_slices((images, np.arange(64))).map(
        image_fns.labelled_flip, num_parallel_calls=2)
    for (image, label), wanted in zip(labelled, explicit, strict=True):
        assert np.array_equal(image, wanted), label


def test_an_int_seed_outside_a_pipeline_is_a_repeatable_sequence() -> None:
    """Eagerly (no element position) an int seed is TensorFlow's op-level seed: a
    sequence, repeatable in a fresh process, whose draws differ from call to call."""
    image = np.arange(2 * 64 * 3).reshape(2, 64, 3)
    flips = [hi.random_flip_left_right(image, seed=123456)[0, 0, 0] for _ in range(32)]
    assert len(set(flips)) == 2


def _philox(seed: tuple[int, int], salt: int) -> np.random.Generator:
    """The stream an op with a seed pair draws from: Philox keyed by the pair, the op's
    salt in the counter's top word (3: crop, 1: flip left-right)."""
    a, b = (v & (2**64 - 1) for v in seed)
    return np.random.Generator(np.random.Philox(key=a << 64 | b, counter=salt << 192))


def _expected_crop(image: np.ndarray, size: tuple[int, ...],
                   seed: tuple[int, int]) -> np.ndarray:
    rng = _philox(seed, 3)
    offsets = [int(rng.integers(0, d - s + 1)) for s, d in zip(size, image.shape, strict=True)]
    return image[tuple(slice(o, o + s) for o, s in zip(offsets, size, strict=True))]


SEED_PAIRS = [(0, 0), (7, 1), (123456, 2**63 + 5), (-3, 2**64 - 1), (2**40, 99)]


def test_a_seed_generator_starts_its_stream_afresh_whatever_was_drawn_before() -> None:
    """The generator an op gets is reused per thread: its state is reset to the stream's
    start, bit for bit a fresh Philox's (no 32-bit half word or block left over)."""
    for _ in range(2):
        for seed in SEED_PAIRS:
            for op, salt in (("crop", 3), ("flip_left_right", 1)):
                want = _philox(seed, salt)
                wanted = (want.random(), want.integers(0, 2**32 - 1, 3).tolist(),
                          want.random(5).tolist())
                got = seed_generator(seed, op)
                assert (got.random(), got.integers(0, 2**32 - 1, 3).tolist(),
                        got.random(5).tolist()) == wanted
                # left mid-block, with half a 32-bit word: the next request starts afresh
                assert seed_generator(seed, op).random() == wanted[0]


def test_a_seed_pair_draws_its_philox_stream_from_the_start_every_time() -> None:
    """Each thread reuses one generator per op, its state reset per call: the draws must
    be those of a fresh Philox stream whatever was drawn before (a crop leaves half a
    32-bit word buffered, a flip a used block), and the same pair gives the same crop."""
    image = np.arange(40 * 30 * 3).reshape(40, 30, 3)
    size = (11, 9, 3)
    for _ in range(2):  # the second round after the first's draws
        for seed in SEED_PAIRS:
            got = hi.random_crop(image, size, seed=seed)
            assert np.array_equal(got, _expected_crop(image, size, seed)), seed
            flipped = hi.random_flip_left_right(got, seed=seed)
            wanted = got[:, ::-1] if _philox(seed, 1).random() < 0.5 else got
            assert np.array_equal(flipped, wanted), seed


def test_threads_drawing_at_once_each_get_their_own_seeds_stream() -> None:
    """Generators are per thread: threads cropping with different seeds at the same time
    get what a sequential run gets."""
    image = np.arange(64 * 64).reshape(64, 64, 1)
    seeds = [(s, i) for s in range(4) for i in range(200)]
    expected = [_expected_crop(image, (8, 8, 1), seed) for seed in seeds]

    def crops(part: list[tuple[int, int]]) -> list[np.ndarray]:
        return [hi.random_crop(image, (8, 8, 1), seed=seed) for seed in part]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between a state's reset and its draws
    try:
        with ThreadPoolExecutor(4) as pool:
            parts = list(pool.map(crops, [seeds[i::4] for i in range(4)]))
    finally:
        sys.setswitchinterval(interval)
    for i in range(4):
        for got, wanted in zip(parts[i], expected[i::4], strict=True):
            assert np.array_equal(got, wanted)
