"""One-import migration: ``from headrace import tf_compat as tf``.

A tf.data pipeline uses a small part of TensorFlow: ``tf.data``, ``tf.io``'s parsers and
writer, ``tf.train``'s Example messages, dtypes, ``tf.TensorSpec`` and a few helpers
such as ``tf.constant`` and ``tf.cast``. This module exposes those names over headrace,
so such a pipeline runs after changing its import alone - without TensorFlow installed.

What differs, and why:

* Elements are NumPy. Iterating a dataset gives arrays that also answer ``.numpy()``
  (:class:`EagerArray`, a read-only ``np.ndarray`` view), so eager loops written for
  TensorFlow (``for batch in ds: batch.numpy()``) run unchanged. Map functions receive
  NumPy values: use NumPy in them (``tf.cast`` / ``tf.constant`` here accept and return
  arrays).
* Dtypes are NumPy's (``tf.float32`` is ``np.float32``, ``tf.string`` is ``bytes``).
  Python numbers get TensorFlow's dtypes where tf.data converts them: ints become
  int32 (int64 past its range), floats float32, in ``from_tensor_slices`` /
  ``from_tensors`` inputs, in what ``map`` and ``scan`` functions return, and in
  ``tf.constant``. NumPy values keep their dtype, as in TensorFlow. (headrace's own
  API keeps NumPy's rule: int64 and float64.) ``list_files`` yields ``bytes``.
* ``tf.train.Example(...).SerializeToString()`` gives the bytes of TensorFlow's
  ``SerializeToString(deterministic=True)`` (map keys sorted). TensorFlow's default
  orders map entries by hash; both parse to the same Example.
* ``tf.io.parse_single_example`` mapped and then batched is fused into one columnar
  parse per batch (see :mod:`headrace._transforms.parse_fusion`); VarLen features then
  come out as :class:`~headrace.io.example.RaggedColumn` (``.to_sparse()`` gives
  ``tf.SparseTensor``'s three arrays, ``tf.sparse.to_dense`` pads).
* A name TensorFlow has and this module does not raises :class:`NotSupportedError`
  (an ``AttributeError``) naming it and what to use instead.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from headrace import _dataset, _errors
from headrace import image as _image
from headrace._csv import datasets as _csv
from headrace._options import AUTOTUNE as _AUTOTUNE
from headrace._options import Options as _Options
from headrace._structure import TensorSpec
from headrace._structure import map_structure as _map_structure
from headrace._structure import returned as _returned
from headrace._transforms.parse_fusion import mentions_parse
from headrace.core import node as _node
from headrace.core.run import DatasetIterator as _DatasetIterator
from headrace.io import _example_wire as wire
from headrace.io._ragged import RaggedColumn as _RaggedColumn
from headrace.io._sparse import SparseColumn as _SparseColumn
from headrace.io.example import parsing as _parsing
from headrace.io.example import specs as _specs
from headrace.io.example.encoding import encode_feature_value as _encode_feature_value
from headrace.io.raw import decode_raw as _decode_raw
from headrace.io.tfrecord.writer import TFRecordWriter as _AtomicWriter

__all__ = [
    "EagerArray",
    "NotSupportedError",
    "TensorSpec",
    "bool",
    "cast",
    "constant",
    "convert_to_tensor",
    "data",
    "errors",
    "float16",
    "float32",
    "float64",
    "image",
    "int8",
    "int16",
    "int32",
    "int64",
    "io",
    "keras",
    "sparse",
    "string",
    "train",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
]

Array = npt.NDArray[Any]


class NotSupportedError(_errors.HeadraceError, AttributeError):
    """A TensorFlow name this compatibility module does not provide."""


#: What to use instead of the TensorFlow names people reach for that are not here.
_GUIDANCE = {
    "function": "headrace runs Python functions as they are: drop the @tf.function decorator",
    "py_function": "map functions are plain Python already: call the function directly",
    "numpy_function": "map functions are plain Python already: call the function directly",
    "decode_csv": "tf.decode_csv is TensorFlow 1; use tf.io.decode_csv",
    "layers": "headrace does not provide Keras: import keras itself for models and layers",
    "Model": "headrace does not provide Keras: pass the dataset (an iterable of NumPy "
    "batches) to your real Keras model.fit",
    "distribute": "shard the input with Dataset.shard or headrace.auto_shard",
    "Tensor": "elements are NumPy arrays (EagerArray); test with isinstance(x, np.ndarray)",
    "SparseTensor": "parsed sparse features are _SparseColumn / _RaggedColumn (.to_sparse())",
    "RaggedTensor": "ragged features are headrace.io.example.RaggedColumn",
    "Variable": "headrace has no variables: keep state in Python",
    "config": "headrace has no devices to configure; its budget is _Options(memory_budget=...)",
    "random": "use NumPy's random generators in map functions (np.random.default_rng)",
    "strings": "elements are bytes: use Python's bytes methods in map functions",
    "math": "use NumPy (np.*) in map functions",
    "linalg": "use NumPy (np.linalg) in map functions",
    "reshape": "use np.reshape in map functions",
    "concat": "use np.concatenate in map functions",
    "stack": "use np.stack in map functions",
    "one_hot": "use np.eye(depth)[indices] in map functions",
    "compat": "tf.compat.v1 APIs (make_one_shot_iterator, Session) have no headrace form; "
    "iterate the dataset",
    "print": "use Python's print",
    "debugging": "use Python assertions in map functions",
}


def _missing(where: str, name: str) -> NotSupportedError:
    hint = _GUIDANCE.get(name, "")
    if not hint and where == "tf.data.Dataset":
        hint = "see headrace.Dataset for the transformations headrace has"
    return NotSupportedError(
        f"{where}.{name} is not provided by headrace.tf_compat"
        + (f": {hint}" if hint else "; write it with NumPy, or see the migration "
           "guide (docs/migration.md) for the headrace form")
    )


class _Namespace:
    """A module-like namespace (``tf.data``, ``tf.io``) that refuses unknown names
    with guidance instead of a bare AttributeError."""

    def __init__(self, path: str, **names: Any) -> None:
        self.__dict__["_path"] = path
        self.__dict__.update(names)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _missing(self.__dict__["_path"], name)

    def __dir__(self) -> list[str]:
        return sorted(key for key in self.__dict__ if not key.startswith("_"))

    def __repr__(self) -> str:
        return f"<headrace.tf_compat namespace {self.__dict__['_path']}>"


# --------------------------------------------------------------------------- dtypes

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
bool = np.bool_
string = bytes


def _numpy_dtype(dtype: Any) -> np.dtype[Any]:
    if dtype in (bytes, str, "string"):
        return np.dtype(object)
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- values

#: headrace.image functions exposed as tf.io.* and tf.image.*, under TensorFlow's names.
_IO_IMAGE = (
    "decode_jpeg", "decode_png", "decode_image", "decode_gif", "decode_bmp",
    "decode_and_crop_jpeg", "extract_jpeg_shape", "is_jpeg",
)
_TF_IMAGE = (
    *_IO_IMAGE, "ResizeMethod", "resize", "convert_image_dtype", "central_crop",
    "crop_to_bounding_box", "flip_left_right", "flip_up_down", "adjust_brightness",
    "adjust_contrast", "per_image_standardization", "random_crop", "random_flip_left_right",
    "random_flip_up_down", "random_brightness", "random_contrast",
    "sample_distorted_bounding_box", "stateless_random_crop",
    "stateless_random_flip_left_right", "stateless_random_flip_up_down",
    "stateless_random_brightness", "stateless_random_contrast",
    "stateless_sample_distorted_bounding_box", "adjust_gamma", "adjust_hue",
    "adjust_saturation", "grayscale_to_rgb", "hsv_to_rgb", "pad_to_bounding_box",
    "random_hue", "random_saturation", "resize_with_crop_or_pad", "resize_with_pad",
    "rgb_to_grayscale", "rgb_to_hsv", "rot90", "stateless_random_hue",
    "stateless_random_saturation", "total_variation", "transpose", "rgb_to_yiq",
    "yiq_to_rgb", "rgb_to_yuv", "yuv_to_rgb",
)


_INT32 = range(-(1 << 31), 1 << 31)
_NUMBERS = {int, float, builtins.bool}


def _python_leaves(value: Any) -> list[Any] | None:
    """The leaves of a (nested) list of Python numbers, or None if anything else is in
    it (a NumPy value keeps its dtype, as TensorFlow keeps it)."""
    leaves: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is list or type(item) is tuple:
            stack.extend(item)
        elif type(item) in (int, float, builtins.bool):
            leaves.append(item)
        else:
            return None
    return leaves


def _tf_value(value: Any) -> Any:
    """A component as ``tf.convert_to_tensor`` types Python numbers: ints int32 (int64
    when one does not fit int32), floats (or ints mixed with floats) float32, bools
    bool. Anything else (NumPy values, strings, ints past int64) is left to headrace.
    """
    kind = type(value)
    if kind is builtins.bool:
        return np.bool_(value)
    if kind is int:
        return np.int32(value) if value in _INT32 else value
    if kind is float:
        return np.float32(value)
    if kind is not list or not value:
        return value
    return _tf_list(value)


def _tf_list(value: list[Any]) -> Any:
    """:func:`_tf_value` of a non-empty list: an array typed as TensorFlow types the
    nested list of numbers, or the list itself when it is not one."""
    kinds = set(map(type, value))  # (a flat list is looked at in C)
    if not kinds <= _NUMBERS:
        leaves = _python_leaves(value)
        if not leaves:
            return value
        kinds = set(map(type, leaves))
    if builtins.bool in kinds and kinds != {builtins.bool}:
        return value  # TensorFlow refuses bools mixed with numbers; headrace decides
    try:
        if kinds == {builtins.bool}:
            return np.asarray(value, dtype=np.bool_)
        if float in kinds:
            return np.asarray(value, dtype=np.float32)
        array = np.asarray(value, dtype=np.int64)
    except (OverflowError, ValueError):
        # past int64, or ragged: headrace's own rule refuses it, saying why
        return value
    if array.size and (array.min() < _INT32.start or array.max() >= _INT32.stop):
        return array  # int64, as TensorFlow makes it
    return array.astype(np.int32)


def _tf_element(element: Any) -> Any:
    """Every component of ``element`` through :func:`_tf_value`."""
    return _map_structure(_tf_value, element)


class _TFTyped:
    """A user function whose results get TensorFlow's dtypes for Python numbers (see
    :func:`_tf_value`); a list it returns is a tuple of components, as in tf.data.
    Picklable when the function is (a map on worker processes)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__wrapped__ = fn  # what a fusion rule reads (map(decode_csv).batch)
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__qualname__)
        self.__module__ = getattr(fn, "__module__", None) or __name__

    def __call__(self, *args: Any) -> Any:
        return _tf_element(_returned(self.fn(*args)))


def _tf_typed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped by :class:`_TFTyped`, except a function that only parses records
    (``parse_single_example``): its dtypes are its features', and left unwrapped the
    map before a batch is fused into one parse per batch."""
    if not callable(fn) or mentions_parse(fn):
        return fn
    return _TFTyped(fn)


class EagerArray(np.ndarray):  # type: ignore[type-arg]
    """An ``np.ndarray`` that also answers ``.numpy()``, as an eager TensorFlow tensor."""

    def numpy(self) -> Any:
        """The plain NumPy value: an array, or a scalar (bytes for a string) for rank 0."""
        plain = self.view(np.ndarray)
        return plain[()] if plain.ndim == 0 else plain


def _eager(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.view(EagerArray)
    if isinstance(value, np.generic):
        return np.asarray(value).view(EagerArray)
    if isinstance(value, bytes):
        scalar = np.empty((), dtype=object)
        scalar[()] = value
        return scalar.view(EagerArray)
    return value


def constant(value: Any, dtype: Any = None, shape: Any = None, name: str | None = None) -> Any:
    """``tf.constant``: a NumPy array of ``value`` (answers ``.numpy()``)."""
    if isinstance(value, bytes | str) and dtype in (None, bytes, "string"):
        return _eager(value.encode() if isinstance(value, str) else value)
    if dtype is None:  # Python numbers: TensorFlow's int32 / float32
        value = _tf_value(value)
    array = np.asarray(value, dtype=None if dtype is None else _numpy_dtype(dtype))
    if shape is not None:
        array = np.broadcast_to(array, tuple(shape)).copy()
    return array.view(EagerArray)


convert_to_tensor = constant


def cast(x: Any, dtype: Any, name: str | None = None) -> Any:
    """``tf.cast``: ``x`` as a NumPy array of ``dtype``."""
    return np.asarray(x).astype(_numpy_dtype(dtype), copy=False)


def _sparse_to_dense(sp_input: Any, default_value: Any = None, validate_indices: Any = True,
                     name: str | None = None) -> Array:
    """``tf.sparse.to_dense`` for _SparseColumn / _RaggedColumn (arrays pass through)."""
    if isinstance(sp_input, _SparseColumn | _RaggedColumn):
        return sp_input.to_dense(default_value)
    return np.asarray(sp_input)


# --------------------------------------------------------------------------- tf.data


class _EagerIterator:
    """The dataset's iterator, its elements as :class:`EagerArray`; everything else (
    ``get_state``, ``close``, ``stats``) is the headrace iterator's."""

    def __init__(self, inner: _DatasetIterator) -> None:
        self._inner = inner

    def __iter__(self) -> _EagerIterator:
        return self

    def __next__(self) -> Any:
        return _map_structure(_eager, next(self._inner))

    def get_next(self) -> Any:
        return next(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _EagerIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


def _as_compat(dataset: _dataset.Dataset) -> Dataset:
    return Dataset(dataset.node, dataset.options)


class Dataset(_dataset.Dataset):
    """``tf.data.Dataset``: headrace's Dataset whose iterators give :class:`EagerArray`
    elements, and whose transformations stay in this class."""

    __slots__ = ()

    def _wrap(self, node: Any) -> Dataset:
        return Dataset(node, self._options)

    def __iter__(self) -> Any:
        return _EagerIterator(super().__iter__())

    def as_numpy_iterator(self) -> _DatasetIterator:
        """Plain NumPy elements (headrace's own iterator)."""
        return super().__iter__()

    def with_options(self, options: _Options) -> Dataset:
        return _as_compat(super().with_options(options))

    @staticmethod
    def from_tensor_slices(tensors: Any, name: str | None = None) -> Dataset:
        """``tf.data.Dataset.from_tensor_slices``; Python numbers as TensorFlow types them."""
        return _as_compat(_dataset.Dataset.from_tensor_slices(_tf_element(tensors)))

    @staticmethod
    def from_tensors(tensors: Any, name: str | None = None) -> Dataset:
        """``tf.data.Dataset.from_tensors``; Python numbers as TensorFlow types them."""
        return _as_compat(_dataset.Dataset.from_tensors(_tf_element(tensors)))

    def map(  # type: ignore[override]
        self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
        deterministic: builtins.bool | None = None, name: str | None = None,
        **headrace_options: Any,
    ) -> Dataset:
        """``tf.data.Dataset.map``; Python numbers the function returns get TensorFlow's
        dtypes (int32, float32)."""
        return _as_compat(super().map(
            _tf_typed(map_func), num_parallel_calls, deterministic, **headrace_options))

    def scan(self, initial_state: Any, scan_func: Callable[[Any, Any], Any],
             name: str | None = None) -> Dataset:
        """``tf.data.Dataset.scan``; Python numbers (the initial state, what the function
        returns) get TensorFlow's dtypes."""
        return _as_compat(super().scan(_tf_element(initial_state), _tf_typed(scan_func)))

    @staticmethod
    def range(*args: int, **kwargs: Any) -> Dataset:  # type: ignore[override]
        kwargs.pop("name", None)
        return _as_compat(_dataset.Dataset.range(*args, **kwargs))

    @staticmethod
    def from_generator(  # type: ignore[override]
        generator: Callable[..., Any], output_types: Any = None, output_shapes: Any = None,
        args: Sequence[Any] | None = None, output_signature: Any = None, name: str | None = None,
    ) -> Dataset:
        """``tf.data.Dataset.from_generator``: ``output_signature``, or ``output_types``
        with or without ``output_shapes`` (unknown shapes then, as in tf.data)."""
        return _as_compat(_dataset.Dataset.from_generator(
            generator, output_types=output_types, output_shapes=output_shapes, args=args,
            output_signature=output_signature))

    @staticmethod
    def zip(*datasets: Any, name: str | None = None) -> Dataset:
        return _as_compat(_dataset.Dataset.zip(*datasets))

    @staticmethod
    def list_files(file_pattern: Any, shuffle: builtins.bool | None = None, seed: int | None = None,
                   name: str | None = None) -> Dataset:
        """``tf.data.Dataset.list_files``: the paths as ``bytes``, as tf.data's strings."""
        paths = _dataset.Dataset.list_files(file_pattern, shuffle, seed)
        return _as_compat(paths.map(os.fsencode, output_signature=TensorSpec((), bytes)))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _missing("tf.data.Dataset", name)


def TFRecordDataset(
    filenames: Any, compression_type: str | None = None, buffer_size: int | None = None,
    num_parallel_reads: int | None = None, name: str | None = None, **headrace_options: Any,
) -> Dataset:
    """``tf.data.TFRecordDataset`` (headrace's, with its extra keyword options)."""
    return _as_compat(_dataset.TFRecordDataset(
        filenames, compression_type, buffer_size, num_parallel_reads, **headrace_options
    ))


def TextLineDataset(
    filenames: Any, compression_type: str | None = None, buffer_size: int | None = None,
    num_parallel_reads: int | None = None, name: str | None = None, **headrace_options: Any,
) -> Dataset:
    """``tf.data.TextLineDataset``."""
    return _as_compat(_dataset.TextLineDataset(
        filenames, compression_type, buffer_size, num_parallel_reads, **headrace_options
    ))


def _compat_csv_dataset(*args: Any, **kwargs: Any) -> Dataset:
    return _as_compat(_csv.CsvDataset(*args, **kwargs))


def _compat_make_csv_dataset(*args: Any, **kwargs: Any) -> Dataset:
    return _as_compat(_csv.make_csv_dataset(*args, **kwargs))


data = _Namespace(
    "tf.data",
    Dataset=Dataset,
    TFRecordDataset=TFRecordDataset,
    TextLineDataset=TextLineDataset,
    AUTOTUNE=_AUTOTUNE,
    INFINITE_CARDINALITY=_node.INFINITE,
    UNKNOWN_CARDINALITY=_node.UNKNOWN,
    Options=_Options,
    experimental=_Namespace(
        "tf.data.experimental",
        AUTOTUNE=_AUTOTUNE,
        INFINITE_CARDINALITY=_node.INFINITE,
        UNKNOWN_CARDINALITY=_node.UNKNOWN,
        CsvDataset=_compat_csv_dataset,
        make_csv_dataset=_compat_make_csv_dataset,
        cardinality=lambda dataset: dataset.cardinality(),
    ),
)
"""``tf.data``: ``Dataset``, ``Options``, ``AUTOTUNE`` and the rest, as headrace's own."""


# --------------------------------------------------------------------------- tf.train


def _float32_values(value: Iterable[Any]) -> list[float]:
    return [float(item) for item in np.asarray(list(value), dtype=np.float32)]


class _List:
    """Base of the three list messages: a ``value`` list and proto-like methods."""

    kind = ""

    def __init__(self, value: Iterable[Any] = ()) -> None:
        self.value = self._check(list(value))

    def _check(self, values: list[Any]) -> list[Any]:
        return values

    def __eq__(self, other: object) -> builtins.bool:
        return isinstance(other, _List) and type(other) is type(self) and other.value == self.value

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self.value!r})"


class BytesList(_List):
    """``tf.train.BytesList``: bytes only (TensorFlow refuses ``str`` too)."""

    kind = "bytes_list"

    def _check(self, values: list[Any]) -> list[Any]:
        for value in values:
            if not isinstance(value, bytes | np.bytes_):
                raise TypeError(f"expected bytes, {type(value).__name__} found")
        return [bytes(value) for value in values]


class FloatList(_List):
    """``tf.train.FloatList``: values stored as float32, as the proto does."""

    kind = "float_list"

    def _check(self, values: list[Any]) -> list[Any]:
        return _float32_values(values)


class Int64List(_List):
    """``tf.train.Int64List``: integers only (a float raises TypeError, as TensorFlow)."""

    kind = "int64_list"

    def _check(self, values: list[Any]) -> list[Any]:
        out = []
        for value in values:
            if isinstance(value, float | np.floating):
                raise TypeError(f"{type(value).__name__!r} object cannot be interpreted as an "
                                "integer")
            out.append(int(value))
        return out


_LIST_TYPES: dict[str, type[_List]] = {
    "bytes_list": BytesList, "float_list": FloatList, "int64_list": Int64List
}


class Feature:
    """``tf.train.Feature(bytes_list=..., float_list=..., int64_list=...)``: one list (the
    last keyword given wins, as protobuf's oneof)."""

    def __init__(self, **kinds: _List | None) -> None:
        self.list: _List | None = None
        for key, given in kinds.items():  # in the order written
            expected = _LIST_TYPES.get(key)
            if expected is None:
                raise TypeError(f"Feature() got an unexpected keyword argument {key!r}")
            if given is not None:
                if not isinstance(given, expected):
                    raise TypeError(f"Feature: {key} must be a {expected.__name__}")
                self.list = given

    def WhichOneof(self, group: str) -> str | None:
        return None if self.list is None else self.list.kind

    @property
    def bytes_list(self) -> BytesList:
        return self.list if isinstance(self.list, BytesList) else BytesList()

    @property
    def float_list(self) -> FloatList:
        return self.list if isinstance(self.list, FloatList) else FloatList()

    @property
    def int64_list(self) -> Int64List:
        return self.list if isinstance(self.list, Int64List) else Int64List()

    def _encode(self, name: str) -> bytes:
        if self.list is None:
            return b""
        return _encode_feature_value((self.list.kind, self.list.value), name)

    def SerializeToString(self, deterministic: builtins.bool = True) -> bytes:
        return self._encode("feature")

    def __eq__(self, other: object) -> builtins.bool:
        return isinstance(other, Feature) and other.list == self.list

    def __repr__(self) -> str:
        return f"Feature({self.list!r})"


def _feature_of(kind: str, values: Any) -> Feature:
    if kind not in _LIST_TYPES:
        return Feature()
    items = values.tolist() if isinstance(values, np.ndarray) else list(values)
    return Feature(**{kind: _LIST_TYPES[kind](items)})


class Features:
    """``tf.train.Features``: ``feature`` maps names to :class:`Feature`."""

    def __init__(self, feature: Mapping[str, Feature] | None = None) -> None:
        self.feature: dict[str, Feature] = dict(feature or {})

    def _encode(self) -> bytes:
        return wire.encode_features(
            {name: feature._encode(name) for name, feature in self.feature.items()}
        )

    def __eq__(self, other: object) -> builtins.bool:
        return isinstance(other, Features) and other.feature == self.feature


class Example:
    """``tf.train.Example``. :meth:`SerializeToString` gives the bytes of TensorFlow's
    deterministic serialization (names sorted); :meth:`FromString` parses any."""

    def __init__(self, features: Features | None = None) -> None:
        self.features = features if features is not None else Features()

    def SerializeToString(self, deterministic: builtins.bool = True) -> bytes:
        return wire.encode_message_field(1, self.features._encode())

    @classmethod
    def FromString(cls, serialized: bytes) -> Example:
        decoded = _parsing.decode_example(serialized)
        return cls(Features({name: _feature_of(*value) for name, value in decoded.items()}))

    def ParseFromString(self, serialized: bytes) -> int:
        self.features = Example.FromString(serialized).features
        return len(serialized)

    def __eq__(self, other: object) -> builtins.bool:
        return isinstance(other, Example) and other.features == self.features

    def __repr__(self) -> str:
        return f"Example(features={sorted(self.features.feature)})"


class FeatureList:
    """``tf.train.FeatureList``: the Feature of each step."""

    def __init__(self, feature: Iterable[Feature] = ()) -> None:
        self.feature = list(feature)


class FeatureLists:
    """``tf.train.FeatureLists``: ``feature_list`` maps names to :class:`FeatureList`."""

    def __init__(self, feature_list: Mapping[str, FeatureList] | None = None) -> None:
        self.feature_list: dict[str, FeatureList] = dict(feature_list or {})


class SequenceExample:
    """``tf.train.SequenceExample``; serializes deterministically (names sorted)."""

    def __init__(self, context: Features | None = None,
                 feature_lists: FeatureLists | None = None) -> None:
        self.context = context if context is not None else Features()
        self.feature_lists = feature_lists if feature_lists is not None else FeatureLists()

    def SerializeToString(self, deterministic: builtins.bool = True) -> bytes:
        lists = []
        for name in sorted(self.feature_lists.feature_list):
            steps = self.feature_lists.feature_list[name].feature
            body = b"".join(wire.encode_message_field(1, step._encode(name)) for step in steps)
            entry = wire.encode_message_field(1, name.encode("utf-8")) + (
                wire.encode_message_field(2, body)
            )
            lists.append(wire.encode_message_field(1, entry))
        return wire.encode_message_field(1, self.context._encode()) + (
            wire.encode_message_field(2, b"".join(lists))
        )

    @classmethod
    def FromString(cls, serialized: bytes) -> SequenceExample:
        context, lists = _parsing.decode_sequence_example(serialized)
        return cls(
            Features({name: _feature_of(*value) for name, value in context.items()}),
            FeatureLists({
                name: FeatureList(_feature_of(*step) for step in steps)
                for name, steps in lists.items()
            }),
        )


train = _Namespace(
    "tf.train",
    Example=Example,
    Features=Features,
    Feature=Feature,
    BytesList=BytesList,
    FloatList=FloatList,
    Int64List=Int64List,
    SequenceExample=SequenceExample,
    FeatureList=FeatureList,
    FeatureLists=FeatureLists,
)
"""``tf.train``: ``Example``, ``Features``, ``Feature`` and the list protos, for writing records."""


# --------------------------------------------------------------------------- tf.io


class TFRecordWriter:
    """``tf.io.TFRecordWriter(path, options=None)``: ``write(record)``, ``close()``,
    ``with``. The file appears under ``path`` only when closed (an exception inside
    ``with`` leaves no file), where TensorFlow writes in place."""

    def __init__(self, path: str | os.PathLike[str], options: Any = None) -> None:
        compression = options if isinstance(options, str) or options is None else getattr(
            options, "compression_type", None
        )
        self._writer = _AtomicWriter(path, compression or None)

    def write(self, record: bytes) -> None:
        if isinstance(record, str):
            record = record.encode("utf-8")
        self._writer.write(record)

    def flush(self) -> None:
        """Records are written on close (atomically); nothing to do before."""

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._writer.__exit__(exc_type, exc, tb)


io = _Namespace(
    "tf.io",
    parse_example=_parsing.parse_example,
    parse_single_example=_parsing.parse_single_example,
    parse_sequence_example=_parsing.parse_sequence_example,
    parse_single_sequence_example=_parsing.parse_single_sequence_example,
    FixedLenFeature=_specs.FixedLenFeature,
    VarLenFeature=_specs.VarLenFeature,
    FixedLenSequenceFeature=_specs.FixedLenSequenceFeature,
    RaggedFeature=_specs.RaggedFeature,
    SparseFeature=_specs.SparseFeature,
    decode_raw=_decode_raw,
    decode_csv=_csv.decode_csv,
    TFRecordWriter=TFRecordWriter,
    **{name: getattr(_image, name) for name in _IO_IMAGE},
)
"""``tf.io``: the parsing specs and functions of ``headrace.io.example``, ``decode_raw``, ``decode_csv`` and ``TFRecordWriter``."""

def _clear_session(*args: Any, **kwargs: Any) -> None:
    """Nothing to clear: headrace builds no graph, and an iterator frees what it holds
    when it is closed or collected."""


image = _Namespace("tf.image", **{name: getattr(_image, name) for name in _TF_IMAGE})
"""``tf.image``: the decode, resize and augmentation functions of ``headrace.image``."""
keras = _Namespace(
    "tf.keras", backend=_Namespace("tf.keras.backend", clear_session=_clear_session)
)
"""``tf.keras``: only ``backend.clear_session``, which has nothing to clear in headrace."""
sparse = _Namespace("tf.sparse", to_dense=_sparse_to_dense)
"""``tf.sparse``: ``to_dense`` for the sparse columns that parsing returns."""
errors = _Namespace(
    "tf.errors",
    InvalidArgumentError=_errors.InvalidArgumentError,
    DataLossError=_errors.DataLossError,
    ResourceExhaustedError=_errors.MemoryBudgetError,
    OpError=_errors.HeadraceError,
    ParseError=_errors.ParseError,
)
"""``tf.errors``: the exception types, headrace's (each a subclass of ``HeadraceError``)."""


def __getattr__(name: str) -> Any:
    """Any other TensorFlow name: a clear error saying what to use instead."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise _missing("tf", name)
