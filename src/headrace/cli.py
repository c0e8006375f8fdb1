"""The ``headrace`` command line: ``main(argv) -> int``, tested in-process.

``headrace demo`` is the project's main job: it writes a ``.npy`` file larger
than the memory budget, streams it through a realistic pipeline
(map -> shuffle -> batch -> prefetch) and prints throughput, memory growth
against the budget, and what each stage held.

Every subcommand fails the same way: exit status 1 (2 for a bad argument) and one
line on stderr saying what was wrong and where (the file, the value); the traceback
only with ``--debug``. ``profile`` and ``doctor`` keep 1 for what they report (doctor:
a leak) apart from a pipeline that fails: a ``MODULE:FUNCTION`` that names no function
returning a dataset is a bad argument (2), and the pipeline's own code raising (while
it is imported, built or run) is status 3. Paths that must be whole files (``inspect``, ``index``,
``convert``) are refused unless they are regular files: ``/dev/zero`` never ends, a
FIFO blocks its reader, and an index is never written next to a device; an ``--html``
report path that exists must be a regular file too. Counts and sizes past a sane bound
(``MAX_SHARDS``, ``MAX_EPOCHS``, ``MAX_DEMO_SIZE``) are refused as bad arguments. ``demo``
removes its temporary data file whatever happens; a failed ``convert`` leaves no file
and no directory it created.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["console_main", "main"]


class _CommandError(Exception):
    """A failure the command explains itself: printed as its one line, no type name."""


class _UsageError(Exception):
    """A bad command line (argparse's complaint, as one line)."""


class _TargetError(_CommandError):
    """A ``MODULE:FUNCTION`` that names no function returning a dataset: a bad argument
    (exit status 2), told apart from what ``doctor`` reports (1: a leak)."""


class _PipelineError(_CommandError):
    """The user's pipeline code raised (importing its module, calling its builder,
    running it): exit status 3, neither a bad argument nor a leak."""


#: ``main``'s exit status for each error class that has its own (others: 1).
_STATUS: dict[type[BaseException], int] = {_TargetError: 2, _PipelineError: 3}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line and an exit status, not usage text and
    ``SystemExit`` (``main`` returns the status; tests call it in-process)."""

    def error(self, message: str) -> Any:  # argparse's hook: must not return
        raise _UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# Upper bounds of the numbers a command takes: a value past them is a typo or an attack
# (`--shards 99999999999999999999` would create shard names for minutes, `--epochs` of
# that size runs until killed, a `demo --size` past what NumPy can index overflows), so it
# is refused on the command line, in one line, before anything runs.
#: What ``headrace --help`` says first: what the tool does for its user.
_DESCRIPTION = ("headrace: tf.data-style input pipelines under a hard memory budget. "
                "Convert and check TFRecord data, profile a pipeline, look for leaks; "
                "`headrace COMMAND --help` gives a command's options.")

#: ``doctor --epochs`` at least: 2 of warm-up, then 3 measured (a leak is a trend).
DOCTOR_MIN_EPOCHS = 5
_DOCTOR_WHY = " (2 warm-up epochs, then 3 to measure a trend)"
#: The exit statuses ``doctor --help`` and ``profile --help`` list (scripts branch on them).
_DOCTOR_STATUS = (
    "exit status: 0 no leak; 1 something leaks; 2 a bad argument (MODULE:FUNCTION names "
    "no function returning a dataset, an --html that cannot be written), refused before "
    "any epoch runs; 3 the pipeline's own code raised (importing, building or running it)"
)
_PROFILE_STATUS = (
    "exit status: 0 profiled; 1 the command failed (writing the report); 2 a bad "
    "argument (MODULE:FUNCTION names no function returning a dataset, an --html that "
    "cannot be written), refused before the pipeline runs; 3 the pipeline's own code "
    "raised (importing, building or running it)"
)
MAX_SHARDS = 10_000  # each one a file; an empty shard per missing row is allowed
MAX_EPOCHS = 100_000
MAX_DEMO_SIZE = 1 << 44  # 16 TiB


def _byte_size(text: str, maximum: int | None = None) -> int:
    """An argparse type: a positive byte size such as ``512MiB`` (at most ``maximum``)."""
    from headrace._memory.units import format_bytes, parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(
            f"must be at most {format_bytes(maximum)}, got {text[:40]!r}")
    return value


def _demo_size(text: str) -> int:
    """An argparse type: ``demo --size``, a byte size of at most ``MAX_DEMO_SIZE``."""
    return _byte_size(text, MAX_DEMO_SIZE)


def _count(minimum: int, maximum: int | None = None, why: str = "") -> Any:
    """An argparse type: an int of at least ``minimum`` (and at most ``maximum``);
    ``why`` (" (...)") says why the minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{why}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:,}, got {text[:40]!r}")
        return value

    parse.__name__ = "count"
    return parse


def _sql_param(text: str) -> Any:
    """An argparse type: ``convert --param [TYPE:]VALUE`` (see ``sources.sql.parse_param``)."""
    from headrace._sources.sql import parse_param

    try:
        return parse_param(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _output_file(text: str) -> str:
    """An argparse type: a file to write. One that exists must be a regular file: a FIFO
    would block the write forever, a device would take (or refuse) anything. One that
    cannot be written (no such folder, no permission) is refused before anything runs."""
    import stat

    if text:
        try:
            mode = os.stat(text).st_mode
        except OSError:
            mode = None  # a new file
        if mode is not None and not stat.S_ISREG(mode):
            from headrace.io.files import describe_file_type

            raise argparse.ArgumentTypeError(
                f"{text!r} is {describe_file_type(mode)}, not a regular file")
        if mode is None:
            _check_writable_folder(text)  # refused now, not after the run
        _try_writing(text, new=mode is None)
    return text


def _try_writing(text: str, *, new: bool) -> None:
    """Refuse a file the report could not be written to, by trying: a new one is made
    and removed again (a name too long, a read-only file system), an existing one is
    opened for appending and written nothing (no permission, a /proc file that takes no
    writes); the file's content and times are left as they were."""
    try:
        if new:
            fd = os.open(text, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.unlink(text)
        else:
            fd = os.open(text, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, b"")
            finally:
                os.close(fd)
    except FileExistsError:
        pass  # (made meanwhile: written over at the end, as any existing file)
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"{text[:80]!r}{'...' if len(text) > 80 else ''} cannot be written "
            f"({error.strerror or error})") from None


def _check_writable_folder(text: str) -> None:
    """Refuse (as a bad argument) a new file whose folder is missing or not writable:
    ``doctor --html`` found it only after all its epochs had run."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {folder!r} {what}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be written: its folder {folder!r} is not writable")


def _one_line(error: BaseException, command: str) -> str:
    """``error`` as one line: its message (with its type where it is not one of
    headrace's or an OSError, whose messages say what they are), the first line of a
    longer one, without a repeat of the ``command: `` the line starts with."""
    from headrace._errors import HeadraceError

    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += " [...]"
    if not isinstance(error, (HeadraceError, OSError, _CommandError)) or not text:
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text.removeprefix(f"{command}: ")


class _PeakSampler:
    """Samples the process's charged memory (anonymous + shared) on a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        from headrace._memory.system import process_memory

        self._read = process_memory
        self.start = process_memory()
        self.peak = self.start.charged
        self.peak_file = self.start.file_backed
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            now = self._read()
            self.peak = max(self.peak, now.charged)
            self.peak_file = max(self.peak_file, now.file_backed)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start.charged


def _write_npy(path: str, rows: int, width: int) -> None:
    """Write a float32 (rows, width) ``.npy`` chunk by chunk: never whole in memory.

    Written under a temporary name and renamed when complete: a write that fails (a
    full disk, Ctrl-C) leaves nothing that a later ``--dir`` run would take as data.
    """
    partial = f"{path}.{secrets.token_hex(4)}.partial"
    try:
        out = np.lib.format.open_memmap(
            partial, mode="w+", dtype=np.float32, shape=(rows, width)
        )
        rng = np.random.default_rng(0)
        chunk = max(1, (16 << 20) // (width * 4))
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            out[start:stop] = rng.standard_normal((stop - start, width), dtype=np.float32)
        out.flush()
        del out
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise


def _augment(row: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A typical per-example step: scale, shift and clip into a fresh float16 row."""
    out = np.multiply(row, 0.5, dtype=np.float32)
    np.clip(out, -3.0, 3.0, out=out)
    half: np.ndarray[Any, Any] = out.astype(np.float16)
    return half


def _demo(args: argparse.Namespace) -> int:
    if args.dir and not os.path.isdir(args.dir):
        raise _CommandError(f"--dir {args.dir}: not a directory")
    directory = args.dir or tempfile.mkdtemp(prefix="headrace-demo-")
    try:
        return _run_demo(args, directory)
    finally:
        if not args.dir:  # the temporary data file goes, whether the run worked or not
            shutil.rmtree(directory, ignore_errors=True)


def _run_demo(args: argparse.Namespace, directory: str) -> int:
    import headrace as hr
    from headrace._memory.units import format_bytes

    size, budget = args.size, args.budget
    width = 1024
    rows = -(-size // (width * 4))
    path = os.path.join(directory, "demo.npy")
    if not os.path.exists(path) or os.path.getsize(path) < rows * width * 4:
        print(f"writing {format_bytes(rows * width * 4)} to {path} ...", flush=True)
        _write_npy(path, rows, width)
    dataset = (
        hr.Dataset.from_npy(path)
        .map(_augment, num_parallel_calls=hr.AUTOTUNE)
        .shuffle(args.shuffle, seed=0)
        .batch(args.batch_size)
        .prefetch(hr.AUTOTUNE)
        .with_options(hr.Options(memory_budget=budget))
    )
    print(
        f"streaming {format_bytes(os.path.getsize(path))} ({rows} rows of {width} float32) under "
        f"a {format_bytes(budget)} budget:\n  from_npy -> map(augment, AUTOTUNE) -> "
        f"shuffle({args.shuffle}) -> batch({args.batch_size}) -> prefetch(AUTOTUNE)",
        flush=True,
    )
    checksum = 0.0
    with _PeakSampler() as sampler, iter(dataset) as iterator:
        started = time.perf_counter()
        seen = 0
        for batch in iterator:
            checksum += float(batch[:, 0].sum())
            seen += len(batch)
        elapsed = time.perf_counter() - started
        stats = iterator.stats()
    bound = budget + budget // 10 + (64 << 20)
    verdict = "within" if sampler.growth <= bound else "OVER"
    print(f"\n{seen} rows in {elapsed:.2f} s: {seen / elapsed:,.0f} rows/s (checksum {checksum:.3f})")
    print(
        f"memory growth (anonymous + shared, peak): {format_bytes(sampler.growth)} — {verdict} "
        f"the bound budget + 10% + 64 MiB = {format_bytes(bound)}; file-backed (memmap) peak "
        f"{format_bytes(sampler.peak_file)}, not charged"
    )
    print("\nwhat each stage held:")
    print(stats.format())
    return 0 if verdict == "within" else 1


def _index(args: argparse.Namespace) -> int:
    """``headrace index``: build (or ``--check``) the ``.hrx`` index of each file."""
    from headrace._tools.index import build_indexes, check_indexes

    results = check_indexes(args.files) if args.check else build_indexes(args.files)
    for result in results:
        print(result.format(), file=sys.stdout if result.ok else sys.stderr)
    bad = sum(not result.ok for result in results)
    if args.check and len(results) > 1:
        print(f"{len(results) - bad} of {len(results)} indexes ok")
    return 1 if bad else 0


def _inspect(args: argparse.Namespace) -> int:
    """``headrace inspect``: count, schema, sizes, CRC check and first records per file."""
    from headrace._tools.inspect import format_report, inspect_tfrecord

    corrupt = unreadable = 0
    total_records = 0
    printed = False
    for path in args.files:
        report = inspect_tfrecord(
            path,
            compression_type=args.compression_type,
            verify_crc=not args.no_crc,
            sample_records=args.records,
        )
        if report.readable:  # the report on stdout; what is wrong, one line on stderr
            if printed:
                print()
            print(format_report(report))
            printed = True
        if report.corruption is not None:
            message = " ".join(report.corruption[1].split()).removeprefix("inspect: ")
            where = "" if path in message else f"{path}: "
            print(f"headrace inspect: {where}{message}", file=sys.stderr)
        unreadable += not report.readable  # (missing, or not a file: not corrupt)
        corrupt += report.readable and not report.ok
        total_records += report.records
    if len(args.files) > 1:
        missing = f", {unreadable} unreadable" if unreadable else ""
        print(f"\n{len(args.files)} files, {total_records:,} records, {corrupt} corrupt{missing}")
    return 1 if corrupt or unreadable else 0


def _convert(args: argparse.Namespace) -> int:
    """``headrace convert``: CSV / SQL / .npy -> TFRecord shards, or TFRecord -> CSV."""
    from headrace._errors import HeadraceError
    from headrace._tools.convert import source_kind, tfrecords_to_csv, to_tfrecords

    progress: Any = {"auto": True, "always": "always", "never": False}[args.progress]
    try:
        if source_kind(args.source[0]) == "tfrecord":
            summary = tfrecords_to_csv(list(args.source), args.dest, compression_type=args.compression_type,
                                       limit=args.limit, progress=progress)
        else:
            if len(args.source) > 1:
                print(f"headrace convert: error: one source at a time, got {args.source}",
                      file=sys.stderr)
                return 2
            summary = to_tfrecords(
                args.source[0], args.dest, num_shards=args.shards, query=args.query,
                table=args.table, key=args.key, params=args.param or (), feature=args.feature,
                batch_size=args.batch_size, field_delim=args.delimiter,
                infer_rows=args.infer_rows or None, compression_type=args.compression_type,
                memory_budget=args.memory_budget, progress=progress,
                null_defaults=args.null_default or (),
            )
    except (HeadraceError, OSError) as error:
        print(f"headrace convert: error: {_one_line(error, 'convert')}; nothing was written",
              file=sys.stderr)
        return 1
    if args.dest != "-":
        print(summary.format())
    return 0


def _load_pipeline(target: str) -> Any:
    """Call ``module:function`` (or ``path/to/file.py:function``) and return its dataset.

    What fails in the user's code (a syntax error, an exception while importing or
    calling) is one line naming ``target``; ``--debug`` shows its traceback.
    """
    try:
        return _call_target(target)
    except _CommandError:
        raise
    except Exception as error:  # (an OSError too: the user's code opening a file)
        raise _PipelineError(f"{target}: {_one_line(error, '')}") from error


def _call_target(target: str) -> Any:
    import importlib
    import importlib.util

    module_name, sep, function_name = target.rpartition(":")
    if not sep or not module_name or not function_name:
        raise _TargetError(f"expected MODULE:FUNCTION (or path/file.py:FUNCTION), got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        from headrace._errors import InvalidArgumentError
        from headrace.io.files import require_regular_file

        try:
            require_regular_file(module_name, "the pipeline's file")
        except (OSError, InvalidArgumentError) as error:  # (missing, a folder, a device)
            raise _TargetError(_one_line(error, "")) from None
        # As `python dir/file.py` would: the file's own directory first on sys.path, so
        # it imports the modules beside it
        folder = os.path.dirname(os.path.abspath(module_name))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location("_headrace_target", module_name)
        if spec is None or spec.loader is None:
            raise _TargetError(f"cannot load {module_name!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would: the current directory
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is None or not module_name.startswith(error.name):
                raise  # the module exists; something it imports does not
            raise _TargetError(
                f"no module named {error.name!r} (for {target!r}: run from the directory "
                "that holds it, or give path/to/file.py:FUNCTION)"
            ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise _TargetError(f"{module_name} has no function {function_name!r}")
    return function()


def _is_tf_dataset(value: Any) -> bool:
    return any(
        klass.__module__.startswith("tensorflow") and klass.__name__ == "DatasetV2"
        for klass in type(value).__mro__
    )


def _profile(args: argparse.Namespace) -> int:
    """``headrace profile``: run a pipeline, print the stage table, write the HTML report."""
    import headrace as hr
    from headrace.profiling.profiler import profile

    dataset = _load_pipeline(args.target)
    if not isinstance(dataset, hr.Dataset):
        raise _TargetError(
            f"{args.target} returned {type(dataset).__name__}, not a "
            "headrace.Dataset (for a tf.data.Dataset, use `headrace doctor`)"
        )
    if args.budget:
        dataset = dataset.with_options(hr.Options(memory_budget=args.budget))
    with _pipeline_running("profile"):
        result = profile(dataset, steps=args.steps, epochs=args.epochs,
                         progress=args.progress, title=f"headrace profile {args.target}")
    print(result.format())
    if args.html:
        result.write_html(args.html)
        print(f"\nHTML report: {args.html}")
    return 0


class _DoctorProgress:
    """``headrace doctor``'s progress on stderr: a line per epoch (epoch k/n, its time, the
    time since the start, memory), so that a run of minutes shows it is alive."""

    def __init__(self, epochs: int, quiet: bool) -> None:
        self.epochs = epochs
        self.quiet = quiet
        self.started = time.perf_counter()

    def _line(self, what: str, measure: Any) -> None:
        if self.quiet:
            return
        from headrace._memory.units import format_bytes

        memory = f"anon+shm {format_bytes(measure.charged)}"
        if measure.allocated:
            memory = f"allocated {format_bytes(measure.allocated)}, {memory}"
        print(f"headrace doctor: {what}: {measure.elements:,} elements in "
              f"{measure.seconds:.2f} s (elapsed {time.perf_counter() - self.started:.1f} s), "
              f"{memory}", file=sys.stderr, flush=True)

    def epoch(self, measure: Any) -> None:
        self._line(f"epoch {measure.epoch + 1}/{self.epochs}", measure)

    def traced_epoch(self, measure: Any) -> None:
        from headrace.profiling.doctor import ATTRIBUTION_EPOCHS

        self._line(f"leak: traced epoch {measure.epoch - self.epochs + 1}/{ATTRIBUTION_EPOCHS}"
                   " (finding where it was allocated)", measure)


def _doctor(args: argparse.Namespace) -> int:
    """``headrace doctor``: lint, then run several epochs looking for leaks (exit 1 if any)."""
    import headrace as hr

    dataset = _load_pipeline(args.target)
    title = f"headrace doctor {args.target}"
    progress = _DoctorProgress(args.epochs, args.quiet)
    if _is_tf_dataset(dataset):
        from headrace.profiling.tfgraph import diagnose_tf

        with _pipeline_running("doctor"):
            diagnosis = diagnose_tf(dataset, epochs=args.epochs, steps=args.steps,
                                    title=title, budget=args.budget, on_epoch=progress.epoch)
    elif isinstance(dataset, hr.Dataset):
        from headrace.profiling.doctor import diagnose

        if args.budget:
            dataset = dataset.with_options(hr.Options(memory_budget=args.budget))
        with _pipeline_running("doctor"):
            diagnosis = diagnose(dataset, epochs=args.epochs, steps=args.steps, title=title,
                                 deep=args.deep, on_epoch=progress.epoch,
                                 on_traced_epoch=progress.traced_epoch)
    else:
        raise _TargetError(
            f"{args.target} returned {type(dataset).__name__}, not a "
            "headrace.Dataset or a tf.data.Dataset"
        )
    print(diagnosis.format())
    if args.html:
        print(f"\nreport written to {diagnosis.write_html(args.html)}")
    return 0 if diagnosis.healthy else 1


def _parser() -> argparse.ArgumentParser:
    from headrace import __version__

    parser = _Parser(prog="headrace", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"headrace {__version__}")
    debug_help = "on failure, show the traceback instead of one line"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # accepted after the subcommand too; SUPPRESS keeps it from resetting the one above
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=debug_help)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="stream a dataset larger than its budget and print the profile",
        parents=[debug],
    )
    demo.add_argument("--size", type=_demo_size, default="1GiB",
                      help="size of the .npy file to stream")
    demo.add_argument("--budget", type=_byte_size, default="256MiB",
                      help="memory budget of the pipeline")
    demo.add_argument("--batch-size", type=_count(1), default=256)
    demo.add_argument("--shuffle", type=_count(1), default=10_000,
                      help="shuffle buffer (elements)")
    demo.add_argument("--dir", help="keep the data file in this directory (reused next time)")
    demo.set_defaults(run=_demo)

    index = commands.add_parser(
        "index", help="build .hrx record indexes of TFRecord files (any writer), or check them",
        parents=[debug],
    )
    index.add_argument("files", nargs="+", metavar="FILE", help="uncompressed TFRecord files")
    index.add_argument(
        "--check",
        action="store_true",
        help="verify existing indexes instead of writing; exit 1 if any is stale or missing",
    )
    index.set_defaults(run=_index)

    inspect = commands.add_parser(
        "inspect", help="record count, Example schema, sizes and CRC check of TFRecord files",
        parents=[debug],
    )
    inspect.add_argument("files", nargs="+", metavar="FILE", help="TFRecord files")
    inspect.add_argument(
        "--compression-type",
        type=str.upper,
        choices=["GZIP", "ZLIB"],
        default=None,
        help="how the files are compressed (as in TensorFlow); default none",
    )
    inspect.add_argument(
        "--records", type=_count(0), default=3, metavar="N",
        help="records to print (default 3)"
    )
    inspect.add_argument(
        "--no-crc", action="store_true", help="skip CRC32C checks (framing is still checked)"
    )
    inspect.set_defaults(run=_inspect)

    convert = commands.add_parser(
        "convert",
        help="a CSV file, a SQL query or a .npy file -> TFRecord shards of tf.train.Example "
        "(indexed); TFRecord files -> CSV",
        description="SOURCE: a .csv/.csv.gz file, a .npy file, a 'sqlite:///path.db' or "
        "'postgresql://...' URL (with --query or --table) -> TFRecord shards in DEST (a "
        "directory, or a pattern with {shard}); or TFRecord files -> DEST.csv ('-': stdout).",
        parents=[debug],
    )
    convert.add_argument("source", nargs="+", metavar="SOURCE")
    convert.add_argument("dest", metavar="DEST")
    convert.add_argument("--shards", type=_count(1, MAX_SHARDS), default=1, metavar="N",
                         help="number of TFRecord shards (default 1)")
    convert.add_argument("--query", help="SQL source: the query (values only via --param)")
    convert.add_argument("--table", help="SQL source: a whole table, instead of --query")
    convert.add_argument("--param", action="append", metavar="[TYPE:]VALUE", type=_sql_param,
                         help="SQL source: a query parameter (repeat for each, in order): "
                              "text as written, or typed as int:5, float:0.5, bool:true, "
                              "date:2024-01-31, datetime:2024-01-31T12:00:00, "
                              "decimal:1.25, bytes:HEX, null: (str:... keeps text that "
                              "starts with one of these)")
    convert.add_argument("--key", help="SQL source: a unique column to page the read by")
    convert.add_argument("--null-default", action="append", metavar="[COLUMN=]VALUE",
                         help="value for SQL NULLs and empty numeric CSV fields (errors "
                              "without one), parsed as the column's type; COLUMN=VALUE for "
                              "one column, VALUE for all others; repeatable")
    convert.add_argument("--feature", default="x",
                         help=".npy source: the feature name of a plain array (default x)")
    convert.add_argument("--delimiter", default=",", help="CSV source: field delimiter")
    convert.add_argument("--infer-rows", type=_count(0), default=1000, metavar="N",
                         help="CSV source: rows read to infer column types (0: all)")
    convert.add_argument("--batch-size", type=_count(1), default=4096, metavar="ROWS",
                         help="rows read and encoded at once (default 4096)")
    convert.add_argument("--memory-budget", type=_byte_size,
                         help="memory budget of the read, e.g. 256MiB")
    convert.add_argument("--compression-type", type=str.upper, choices=["GZIP", "ZLIB"],
                         default=None, help="compression of the TFRecord files (default none)")
    convert.add_argument("--limit", type=_count(0), metavar="N",
                         help="TFRecord -> CSV: write the first N records only")
    convert.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                         help="progress bar on stderr (auto: when it is a terminal)")
    convert.set_defaults(run=_convert)
    prof = commands.add_parser(
        "profile", help="run module:function's dataset; per-stage table and an HTML report",
        parents=[debug], epilog=_PROFILE_STATUS,
    )
    prof.add_argument("target", metavar="MODULE:FUNCTION",
                      help="a function returning a headrace.Dataset (or path/file.py:function)")
    prof.add_argument("--steps", type=_count(1), default=None,
                      help="elements per epoch (default all)")
    prof.add_argument("--epochs", type=_count(1, MAX_EPOCHS), default=1)
    prof.add_argument("--budget", type=_byte_size, default=None,
                      help="memory budget (e.g. 256MiB)")
    prof.add_argument("--html", type=_output_file, default="headrace-profile.html",
                      help="where to write the report ('' for none)")
    prof.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="live progress line (default: when stderr is a terminal)")
    prof.set_defaults(run=_profile)

    doctor = commands.add_parser(
        "doctor",
        help="lint module:function's pipeline (headrace or tf.data) and look for leaks; "
        "exit 1 if something leaks",
        parents=[debug], epilog=_DOCTOR_STATUS,
    )
    doctor.add_argument("target", metavar="MODULE:FUNCTION",
                        help="a function returning a headrace.Dataset or a tf.data.Dataset")
    doctor.add_argument("--epochs", type=_count(DOCTOR_MIN_EPOCHS, MAX_EPOCHS, _DOCTOR_WHY),
                        default=8, help=f"epochs to run (at least {DOCTOR_MIN_EPOCHS}: "
                        "2 of warm-up, then 3 or more to see a trend; default 8)")
    doctor.add_argument("--steps", type=_count(1), default=None, help="elements per epoch")
    doctor.add_argument("--budget", type=_byte_size, default=None,
                        help="memory budget to judge against")
    doctor.add_argument("--quiet", action="store_true",
                        help="no progress (by default a line per epoch on stderr)")
    doctor.add_argument("--progress", action="store_false", dest="quiet",
                        help="a line per epoch on stderr (the default; undoes --quiet)")
    doctor.add_argument("--deep", action="store_true",
                        help="trace every epoch's allocations with deep tracebacks (many "
                        "times slower; by default only a leak found gets a short traced pass)")
    doctor.add_argument("--html", type=_output_file, default=None, metavar="FILE",
                        help="also write the diagnosis as a self-contained HTML page")
    doctor.set_defaults(run=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status.

    0: done; 1: the command failed (one line on stderr says what and where; the
    traceback too with ``--debug``), or ``doctor`` found a leak; 2: a bad command line
    (for ``profile`` and ``doctor`` also a ``MODULE:FUNCTION`` naming no function that
    returns a dataset, or an ``--html`` that cannot be written); 3: ``profile`` or
    ``doctor``: the pipeline's own code raised (importing it, building it, running it);
    130: interrupted.
    """
    try:
        args = _parser().parse_args(argv)
    except _UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except SystemExit as done:  # --help, --version: argparse printed them
        return done.code if isinstance(done.code, int) else 0
    run: Any = args.run
    try:
        code: int = run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"headrace {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if args.debug:
            raise
        print(f"headrace {args.command}: error: {_one_line(error, args.command)}"
              f"{_debug_hint(error)}", file=sys.stderr)
        return _STATUS.get(type(error), 1)
    return code


def _debug_hint(error: BaseException) -> str:
    """Where an error is not one of ours (a bug, the user's code's), how to see more."""
    from headrace._errors import HeadraceError

    expected = isinstance(error, (HeadraceError, OSError, _CommandError))
    return "" if expected else " (--debug shows the traceback)"


@contextlib.contextmanager
def _pipeline_running(command: str) -> Any:
    """What the user's pipeline raises while it runs: status 3 (``_PipelineError``),
    which ``doctor``'s 1 (a leak) would otherwise be."""
    try:
        yield
    except _CommandError:
        raise
    except Exception as error:
        raise _PipelineError(_one_line(error, command) + _debug_hint(error)) from error


def console_main() -> None:
    """Entry point of the ``headrace`` console script."""
    sys.exit(main())
