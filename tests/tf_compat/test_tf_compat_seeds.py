"""The seed articles' pipelines through ``headrace.tf_compat``, import changed only,
against the same code under real TensorFlow (scaled down).

Each ``article_*`` function below is the article's own code with its data scaled down,
parameterized by the module it runs under (``tf``): once with ``headrace.tf_compat``,
once with ``tensorflow``; the elements must agree. Code the articles write that is not
valid TensorFlow 2 (``tf.decode_csv``; a glob given to TFRecordDataset) is checked to
fail with guidance instead.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as real_tf

import headrace as hr
from headrace import tf_compat
from headrace.io.example import RaggedColumn

pytestmark = pytest.mark.tf


def as_numpy(value: Any) -> Any:
    """Nested Python/NumPy values of a TensorFlow or headrace element, for comparing."""
    if isinstance(value, dict):
        return {key: as_numpy(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return tuple(as_numpy(item) for item in value)
    if isinstance(value, real_tf.SparseTensor):
        return ("sparse", value.indices.numpy().tolist(), value.values.numpy().tolist(),
                value.dense_shape.numpy().tolist())
    if isinstance(value, RaggedColumn):
        indices, values, shape = value.to_sparse()
        return ("sparse", indices.tolist(), values.tolist(), shape.tolist())
    array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    return np.asarray(array).tolist()


def elements(dataset: Any) -> list[Any]:
    return [as_numpy(element) for element in dataset]


# --------------------------------------------------------------------------- seed 000


def article_000_write(tf: Any, path: str, features: Any, features2: Any, labels: Any) -> None:
    def _bytes_feature(value: Any) -> Any:
        """Returns a bytes_list from a string / byte."""
        if isinstance(value, type(tf.constant(0))):
            value = value.numpy()  # BytesList won't unpack a string from an EagerTensor.
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    def _float_feature(value: Any) -> Any:
        """Returns a float_list from a float / double."""
        return tf.train.Feature(float_list=tf.train.FloatList(value=[value]))

    def _int64_feature(value: Any) -> Any:
        """Returns an int64_list from a bool / enum / int / uint."""
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    def serialize_example(feature0: Any, feature1: Any, label: Any) -> Any:
        feature = {
            "feature0": _float_feature(feature0),
            "feature1": _int64_feature(feature1),
            "label": _int64_feature(label),
        }
        example_proto = tf.train.Example(features=tf.train.Features(feature=feature))
        return example_proto.SerializeToString()

    with tf.io.TFRecordWriter(path) as writer:
        for i in range(len(features)):
            example = serialize_example(features[i], features2[i], labels[i])
            writer.write(example)


def test_000_writes_tfrecords_tensorflow_reads_as_its_own(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    features = rng.random(50).astype(np.float32)
    features2 = rng.integers(0, 100, 50)
    labels = rng.integers(0, 2, 50)
    ours, theirs = str(tmp_path / "ours.tfrecords"), str(tmp_path / "theirs.tfrecords")
    article_000_write(tf_compat, ours, features, features2, labels)
    article_000_write(real_tf, theirs, features, features2, labels)
    read_ours = [r.numpy() for r in real_tf.data.TFRecordDataset(ours)]
    read_theirs = [r.numpy() for r in real_tf.data.TFRecordDataset(theirs)]
    # TensorFlow's default serialization orders map keys by hash: compare content, and
    # bytes against its deterministic serialization
    assert [real_tf.train.Example.FromString(r) for r in read_ours] == [
        real_tf.train.Example.FromString(r) for r in read_theirs
    ]
    assert read_ours == [
        real_tf.train.Example.FromString(r).SerializeToString(deterministic=True)
        for r in read_theirs
    ]
    assert [bytes(r) for r in hr.TFRecordDataset(theirs)] == read_theirs


def article_000_pipeline(tf: Any, features: Any, labels: Any) -> Any:
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    dataset = dataset.map(
        lambda x, y: (tf.image.convert_image_dtype(x, dtype=tf.float32), y),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    if tf is real_tf or hasattr(hr.Dataset, "cache"):
        dataset = dataset.cache()  # cache only if dataset fits in memory
    dataset = dataset.shuffle(buffer_size=10000)
    dataset = dataset.batch(32)  # Adjust batch size as needed
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    return dataset


def test_000_batching_pipeline_gives_tensorflows_elements() -> None:
    rng = np.random.default_rng(1)
    features = rng.integers(0, 256, (100, 4, 4, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 100)
    ours = elements(article_000_pipeline(tf_compat, features, labels))
    theirs = elements(article_000_pipeline(real_tf, features, labels))
    assert [len(batch[0]) for batch in ours] == [len(batch[0]) for batch in theirs]
    # shuffled without a seed: the same rows, in some order
    flatten = lambda batches: sorted(  # noqa: E731
        (str(x), y) for batch in batches for x, y in zip(*batch, strict=True)
    )
    assert flatten(ours) == flatten(theirs)
    if not hasattr(hr.Dataset, "cache"):
        with pytest.raises(tf_compat.NotSupportedError, match=r"Dataset\.cache"):
            tf_compat.data.Dataset.range(3).cache()


def article_000_shards(tf: Any, features: Any, labels: Any) -> list[Any]:
    num_shards = 4
    shard_size = len(features) // num_shards
    datasets = []
    for i in range(num_shards):
        start = i * shard_size
        end = (i + 1) * shard_size
        shard_dataset = tf.data.Dataset.from_tensor_slices((features[start:end], labels[start:end]))
        datasets.append(shard_dataset)
    return datasets


def test_000_sharding_gives_tensorflows_elements() -> None:
    features, labels = np.arange(42.0).reshape(21, 2), np.arange(21)
    ours = [elements(d) for d in article_000_shards(tf_compat, features, labels)]
    theirs = [elements(d) for d in article_000_shards(real_tf, features, labels)]
    assert ours == theirs


# --------------------------------------------------------------------------- seed 001


def article_001(tf: Any, large_dataset: Any) -> tuple[list[Any], list[Any], int]:
    def complex_augmentation_function(image: Any) -> Any:
        return image[::-1]

    dataset = tf.data.Dataset.from_tensor_slices(large_dataset).map(complex_augmentation_function)
    dataset = dataset.batch(32)
    dataset = dataset.prefetch(buffer_size=tf.data.AUTOTUNE)
    first = elements(dataset)

    def efficient_augmentation(image: Any) -> Any:
        return image

    dataset = tf.data.Dataset.from_tensor_slices(large_dataset)
    dataset = dataset.map(lambda x: efficient_augmentation(x), num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.batch(32).prefetch(buffer_size=10)

    def data_generator(dataset: Any) -> Any:
        yield from dataset

    return first, [as_numpy(b) for b in data_generator(dataset)], len(dataset)


def test_001_pipelines_give_tensorflows_elements() -> None:
    large_dataset = np.arange(100 * 6, dtype=np.float32).reshape(100, 6)
    assert article_001(tf_compat, large_dataset) == article_001(real_tf, large_dataset)


# --------------------------------------------------------------------------- seed 002


def article_002(tf: Any, data: Any) -> list[Any]:
    out = []
    dataset = tf.data.Dataset.from_tensor_slices(data)
    for element in dataset:
        out.append(element.numpy().tolist())  # Force the entire dataset to be consumed
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(1000)  # Process in batches
    for batch in dataset:
        out.append(batch.numpy().shape)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(1000).prefetch(tf.data.AUTOTUNE)
    for batch in dataset:
        out.append(batch.numpy().shape)
    return out


def test_002_eager_loops_give_tensorflows_values() -> None:
    data = np.random.default_rng(2).random((2500, 5))
    assert article_002(tf_compat, data) == article_002(real_tf, data)


# --------------------------------------------------------------------------- seed 003


def article_003_files(tf: Any, directory: Path, count: int) -> list[str]:
    example = tf.train.Example(features=tf.train.Features(feature={
        "test": tf.train.Feature(int64_list=tf.train.Int64List(value=[1, 2, 3]))}))
    serialized_example = example.SerializeToString()
    for i in range(count):
        with tf.io.TFRecordWriter(str(directory / f"test_file_{i}.tfrecord")) as writer:
            for _ in range(20):
                writer.write(serialized_example)
    return [str(directory / f"test_file_{i}.tfrecord") for i in range(count)]


def article_003_worker(tf: Any, message_queue: Any, output_queue: Any) -> None:
    while True:
        try:
            file_path = message_queue.get(timeout=1)
            if file_path is None:
                break
            dataset = tf.data.TFRecordDataset(file_path)
            for record in dataset:
                output_queue.put(record)
            dataset = None
            del dataset
            tf.keras.backend.clear_session()  # Attempt to clear graph
        except queue.Empty:
            continue


def article_003_interleave(tf: Any, file_paths: list[str]) -> Any:
    files = tf.data.Dataset.from_tensor_slices(file_paths)
    return files.interleave(
        lambda file_path: tf.data.TFRecordDataset(file_path),
        cycle_length=4,
        num_parallel_calls=tf.data.AUTOTUNE,
        block_length=2,
        deterministic=False,
    ).batch(10)


def article_003_sharded(tf: Any, file_paths: list[str], shard_index: int) -> Any:
    files = tf.data.Dataset.from_tensor_slices(file_paths)
    sharded_files = files.shard(4, shard_index)
    dataset = sharded_files.interleave(
        lambda file_path: tf.data.TFRecordDataset(file_path),
        cycle_length=4,  # the article's AUTOTUNE depends on the machine's cores
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=False,
    )
    return dataset.shuffle(1000).batch(10)


@pytest.mark.parametrize("tf", [tf_compat, real_tf], ids=["headrace", "tensorflow"])
def test_003_worker_queue_reads_every_record(tf: Any, tmp_path: Path) -> None:
    paths = article_003_files(tf, tmp_path, 3)
    messages: queue.Queue[Any] = queue.Queue()
    output: queue.Queue[Any] = queue.Queue()
    for path in paths:
        messages.put(path)
    messages.put(None)
    article_003_worker(tf, messages, output)
    records = [as_numpy(output.get()) for _ in range(output.qsize())]
    assert len(records) == 60
    assert records == [as_numpy(r) for p in paths for r in real_tf.data.TFRecordDataset(p)]


def test_003_interleaved_and_sharded_reads_give_tensorflows_records(tmp_path: Path) -> None:
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    ours_paths = article_003_files(tf_compat, tmp_path / "ours", 10)
    theirs_paths = article_003_files(real_tf, tmp_path / "theirs", 10)
    ours = elements(article_003_interleave(tf_compat, ours_paths))
    theirs = elements(article_003_interleave(real_tf, theirs_paths))
    assert [len(b) for b in ours] == [len(b) for b in theirs]  # deterministic=False: sizes
    assert sorted(map(str, ours)) == sorted(map(str, theirs))
    for shard in range(4):
        ours = elements(article_003_sharded(tf_compat, ours_paths, shard))
        theirs = elements(article_003_sharded(real_tf, theirs_paths, shard))
        assert sorted(str(r) for b in ours for r in b) == sorted(str(r) for b in theirs for r in b)


# --------------------------------------------------------------------------- seed 004


def article_004_tfrecord(tf: Any, file_pattern: str, batch_size: int = 32) -> Any:
    def parse_tfrecord_example(example_proto: Any) -> Any:
        feature_description = {
            "feature1": tf.io.FixedLenFeature([], tf.float32),
            "feature2": tf.io.VarLenFeature(tf.int64),
        }
        features = tf.io.parse_single_example(example_proto, feature_description)
        return features["feature1"], features["feature2"]

    dataset = tf.data.TFRecordDataset(file_pattern)
    dataset = dataset.map(parse_tfrecord_example)  # custom parsing function (see below)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(buffer_size=tf.data.AUTOTUNE)
    return dataset


def test_004_parse_single_example_then_batch_gives_tensorflows_batches(tmp_path: Path) -> None:
    path = str(tmp_path / "data.tfrecord")
    with real_tf.io.TFRecordWriter(path) as writer:
        for i in range(70):
            writer.write(real_tf.train.Example(features=real_tf.train.Features(feature={
                "feature1": real_tf.train.Feature(float_list=real_tf.train.FloatList(value=[i / 3])),
                "feature2": real_tf.train.Feature(
                    int64_list=real_tf.train.Int64List(value=list(range(i % 5)))),
            })).SerializeToString())
    ours = elements(article_004_tfrecord(tf_compat, path))
    theirs = elements(article_004_tfrecord(real_tf, path))
    assert ours == theirs


def article_004_csv(tf: Any, file_path: str, batch_size: int = 32) -> Any:
    # the article's tf.decode_csv (TensorFlow 1) as the guidance below says: tf.io.decode_csv
    dataset = tf.data.TextLineDataset(file_path)
    dataset = dataset.skip(1)  # Skip header row if present
    dataset = dataset.map(lambda line: tf.io.decode_csv(line, record_defaults=[[0.0]] * 100))
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(buffer_size=tf.data.AUTOTUNE)
    return dataset


def test_004_csv_pipeline_gives_tensorflows_100_columns(tmp_path: Path) -> None:
    """decode_csv returns a list of 100 columns: a tuple of 100 components, batched
    into 100 (32,) float32 columns, as tf.data makes them (not one (32, 100) array)."""
    rng = np.random.default_rng(4)
    values = rng.random((70, 100)).astype(np.float32)
    path = tmp_path / "large_data.csv"
    path.write_text(",".join(f"c{i}" for i in range(100)) + "\n" + "".join(
        ",".join(repr(float(v)) for v in row) + "\n" for row in values))
    ours = article_004_csv(tf_compat, str(path))
    theirs = article_004_csv(real_tf, str(path))
    assert len(ours.element_spec) == len(theirs.element_spec) == 100
    first = next(iter(ours))
    assert isinstance(first, tuple) and len(first) == 100
    assert first[0].dtype == np.float32 and first[0].shape == (32,)
    assert elements(ours) == elements(theirs)


def article_004_database(tf: Any, connect: Any, query: str, batch_size: int = 32) -> Any:
    def generator() -> Any:
        conn = connect()
        cur = conn.cursor()
        cur.execute(query)
        while True:
            rows = cur.fetchmany(batch_size)
            if not rows:
                break
            yield rows
        conn.close()

    return tf.data.Dataset.from_generator(generator, output_types=(tf.float32, tf.int32))


def test_004_generator_with_output_types_only(tmp_path: Path) -> None:
    """``from_generator(gen, output_types=(tf.float32, tf.int32))`` without shapes is
    accepted (unknown shapes). The article yields whole ``fetchmany`` lists, which are
    not a (float, int) pair: both libraries raise there. Yielding each row works."""
    import sqlite3

    db = str(tmp_path / "mydatabase.sqlite")
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE mytable (feature1 REAL, feature2 INTEGER)")
        conn.executemany("INSERT INTO mytable VALUES (?, ?)", [(i / 4, i) for i in range(40)])
    query = "SELECT feature1, feature2 FROM mytable"
    results = []
    for tf in (tf_compat, real_tf):
        dataset = article_004_database(  # (tf.data calls the generator on its threads)
            tf, lambda: sqlite3.connect(db, check_same_thread=False), query)
        assert [spec.shape for spec in dataset.element_spec] in ([None, None], [
            real_tf.TensorShape(None)] * 2)
        with pytest.raises(Exception, match="structure") as raised:
            next(iter(dataset))
        results.append(raised.type)
    assert issubclass(results[0], hr.HeadraceError)

    def per_row(tf: Any) -> Any:
        def generator() -> Any:
            with sqlite3.connect(db, check_same_thread=False) as conn:
                yield from conn.execute(query)
        return tf.data.Dataset.from_generator(
            generator, output_types=(tf.float32, tf.int32)).batch(16)

    assert elements(per_row(tf_compat)) == elements(per_row(real_tf))


def test_004_tensorflow_1_calls_fail_with_guidance(tmp_path: Path) -> None:
    with pytest.raises(AttributeError):
        real_tf.decode_csv  # noqa: B018 - not TensorFlow 2 either
    with pytest.raises(tf_compat.NotSupportedError, match=r"tf\.decode_csv.*tf\.io\.decode_csv"):
        tf_compat.decode_csv  # noqa: B018
    with pytest.raises(tf_compat.NotSupportedError, match=r"tf\.function.*decorator"):
        tf_compat.function  # noqa: B018


def test_unknown_names_say_what_to_use() -> None:
    for namespace, name in [(tf_compat.io, "gfile"), (tf_compat.data.experimental, "foo"),
                            (tf_compat.train, "Checkpoint"), (tf_compat, "reshape")]:
        with pytest.raises(AttributeError, match=name):
            getattr(namespace, name)
    assert not hasattr(tf_compat, "Session")
    assert os.path.basename(tf_compat.__file__) == "tf_compat.py"
