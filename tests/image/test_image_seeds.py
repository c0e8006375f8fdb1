"""Random image ops seeded with an int (``seed=42``, what a tf.data user writes) inside a
pipeline: the augmentation of an element depends on the element, never on who ran it.

The generator draws pipelines (a source of images, with or without labels; shuffle,
skip, take, shard or repeat below or above the map; a batch after it) and one of the
int-seeded augmentations of ``image_fns``. The oracle is the same pipeline with a
sequential map: run with 1 and 2 threads, on 2 worker processes, and restored from a
checkpoint taken at a random element, it must give the very same outputs.
"""

from __future__ import annotations

from typing import Any

import image_fns
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headrace as hr
import headrace.image as hi

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
