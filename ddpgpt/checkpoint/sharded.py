"""A checkpoint's tensors through torch.distributed.checkpoint (DCP): each rank writes the chunks it
holds, and loading reads whichever chunks a rank needs, whatever mode and world size wrote them.

Every tensor is saved as the logical tensor it is in the single-device model, under one name and
in its own shape, whatever the sync mode: `model.<param>`, `optimizer.adamw.<param>.exp_avg` and
`.exp_avg_sq`, `optimizer.muon.<param>.momentum_buffer`, and `rng.cpu` (W, state bytes): row r
is rank r's generator. What a rank holds of a tensor is a `Pieces`: rectangular chunks of it, each
with its offsets, which is exactly what DCP's metadata records (ChunkStorageMetadata). DCP's
resharding (the overlap of the chunks saved and the chunks wanted) then lets any mode and W load
a checkpoint of any other.

How each mode's holdings become chunks (sync/):
- whole tensors every rank holds alike (the weights under ddp, allreduce, rs-ag and zero1;
  AdamW's moments under the first three): each is written by one rank, `writers` spreading them
  by bytes, so each rank writes about 1/W and stages only that. DCP's planner would deduplicate
  replicated tensors too, but only after every rank had copied all of them to CPU memory.
- fsdp2's DTensors: the local shard, at the offset DTensor computes (`of_dtensor`).
- zero1's slices: rank r steps elements [r·n/W, (r+1)·n/W) of each flat bucket, so it holds a
  contiguous range of each parameter's flattened elements, which cuts rows of a matrix in two. A
  range of a row-major (rows, cols) tensor is at most three rectangles (the end of one row, whole
  rows, the start of another): `flat_range`. That keeps the checkpoint in the parameters' own
  shapes, the layout every other mode reads, rather than the buckets' flat layout (which depends
  on W, run.bucket_mb and the padding) or a DTensor of the flattened state (whose even chunks are
  not zero1's bucket slices); DCP's chunk metadata describes it as it is, and no rank copies
  anything but its own elements.
- Muon's momentum: its owner holds whole matrices, and writes and reads them alone.

`Pieces` is not a torch type, so two small planner subclasses look chunks up in it (DCP's own
lookups accept only tensors). Nothing but tensors goes through DCP: its loader reads any other
object with pickle (torch.load(weights_only=False)), which this project never does; the
`LoadPlanner` refuses such an entry. DCP's index (`.metadata`) is a pickle too: it is read only
after its sha256 matches meta.json, and then with an unpickler that admits DCP's metadata
classes alone (`read_metadata`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pathlib
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ddpgpt.data import storage
from ddpgpt.errors import UserError

INDEX = ".metadata"  # DCP's name for its index of every chunk


class Pieces:
    """This rank's rectangular chunks of one logical tensor of `shape`: (offsets, tensor) pairs,
    each tensor (sizes,) a view of live state or its staged copy."""

    def __init__(self, shape: torch.Size, chunks: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.shape = torch.Size(shape)
        self.chunks = [(tuple(o), t) for o, t in chunks if t.numel() > 0]

    def size(self) -> torch.Size:
        """The logical tensor's shape (DCP's load plan checks it against the saved one)."""
        return self.shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.chunks)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                              properties=dcp_metadata.TensorProperties.create_from_tensor(t),
                              size=self.shape))
                for offsets, t in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), t.shape) for offsets, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.chunks) \
                and torch.Size(self.chunks[index.index][0]) == index.offset:
            return self.chunks[index.index][1]
        for offsets, t in self.chunks:
            if torch.Size(offsets) == index.offset:
                return t
        raise KeyError(f"{index.fqn}: no chunk at {tuple(index.offset)}")

    def map(self, fn) -> Pieces:
        """The same chunks, each tensor replaced by fn(tensor)."""
        return Pieces(self.shape, [(o, fn(t)) for o, t in self.chunks])


def whole(t: torch.Tensor) -> Pieces:
    return Pieces(t.shape, [((0,) * t.dim(), t)])


def of_dtensor(d) -> Pieces:
    """A DTensor's local shard, where DTensor places it in the global tensor."""
    sizes, offsets = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
    local = d.to_local()
    assert tuple(local.shape) == tuple(sizes), (local.shape, sizes)
    return Pieces(d.shape, [(tuple(offsets), local)])


def flat_range(shape: torch.Size, flat: torch.Tensor, start: int) -> Pieces:
    """Elements [start, start + len(flat)) of a row-major tensor of `shape` (1-D or 2-D), `flat`
    (1-D) holding them: at most three rectangles, each a view of `flat`."""
    n = flat.numel()
    if len(shape) == 1:
        return Pieces(shape, [((start,), flat)])
    assert len(shape) == 2, f"flat_range: {len(shape)}-D tensors are not laid out here"
    cols, chunks, done = shape[1], [], 0
    while done < n:
        row, col = divmod(start + done, cols)
        if col or n - done < cols:  # a partial row: from `col` to the row's end or the range's
            width = min(cols - col, n - done)
            chunks.append(((row, col), flat[done:done + width].view(1, width)))
            done += width
        else:  # whole rows
            rows = (n - done) // cols
            chunks.append(((row, 0), flat[done:done + rows * cols].view(rows, cols)))
            done += rows * cols
    return Pieces(shape, chunks)


def rng(env, fresh: bool = False) -> dict[str, Pieces]:
    """This rank's generator states as row `rank` of (W, bytes) tensors, `rng.cpu` (and
    `rng.cuda`): every rank writes its own row, and reads it back at the same W. `fresh`: zeros
    to load into. (`env`: a DistEnv.)"""
    states = {"cpu": torch.get_rng_state()}
    if env.device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(env.device)
    return {f"rng.{k}": Pieces((env.world_size, v.numel()),
                               [((env.rank, 0), (torch.zeros_like(v) if fresh else v).view(1, -1))])
            for k, v in states.items()}


def writers(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Which rank writes each of the tensors every rank holds alike: the largest first, each to
    the rank with the fewest bytes so far (ties: the lower rank). The same on every rank, since it
    depends on names and sizes only; no rank gets more than 1/W of the bytes + the largest."""
    load, out = [0] * world, {}
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += sizes[name]
    return out


def share(held: dict[str, Pieces], replicated: set[str], rank: int, world: int
          ) -> dict[str, Pieces]:
    """What this rank writes of what it holds: its own chunks, and the replicated tensors
    `writers` gives it."""
    owner = writers({k: held[k].nbytes for k in replicated}, world)
    return {k: v for k, v in held.items() if k not in replicated or owner[k] == rank}


# ---- DCP, with chunks looked up in Pieces ----------------------------------------------------

class SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class LoadPlanner(DefaultLoadPlanner):
    """Loads into Pieces, in place; refuses anything but tensors."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DefaultLoadPlanner would first replace every object it does not know by None.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator, self.mappings = metadata, is_coordinator, {}

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)

    def load_bytes(self, read_item, value) -> None:
        raise UserError(f"checkpoint entry {read_item.dest_index.fqn} is a pickled object, "
                        "which ddpgpt never writes or reads")


class Writer(FileSystemWriter):
    """DCP's writer (every file fsynced), noting the files this rank wrote, and its own failure
    as raised here: DCP hands every rank a pickled copy, which has lost the OS's error behind
    torch's ("unexpected pos ..."). Into object storage (`remote`: the subclass from `writer`,
    on torch's FsspecWriter) it also hashes every file on its way out (`digests`), so that
    meta.json lists their sha256 without downloading them again."""

    def __init__(self, path: os.PathLike, remote: bool = False):
        extra = {"use_listings_cache": False} if remote else {}
        super().__init__(path, single_file_per_rank=True, sync_files=not remote, thread_count=1,
                         overwrite=remote, **extra)
        self.files: list[str] = []
        self.digests: dict[str, str] = {}
        self.error: BaseException | None = None
        if remote:
            self._hash_streams()

    def prepare_local_plan(self, plan):
        return self._noting(super().prepare_local_plan, plan)

    def write_data(self, plan, planner):
        results = self._noting(super().write_data, plan, planner)
        self.files = sorted({r.storage_data.relative_path for r in results.value()})
        return results

    def finish(self, metadata, results) -> None:
        self._noting(super().finish, metadata, results)
        if f"{INDEX}.tmp" in self.digests:  # written under a temporary name, then renamed
            self.digests[INDEX] = self.digests.pop(f"{INDEX}.tmp")

    def _noting(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as e:
            self.error = e
            raise

    def _hash_streams(self) -> None:
        opened = self.fs.create_stream

        @contextlib.contextmanager
        def hashing(path, mode):
            with opened(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                digest = hashlib.sha256()
                yield _Hashing(stream, digest)
                self.digests[os.path.basename(os.fspath(path))] = digest.hexdigest()

        self.fs.create_stream = hashing


class _Hashing:
    """A stream that hashes what is written through it."""

    def __init__(self, stream, digest):
        self._stream, self._digest = stream, digest

    def write(self, data) -> int:
        self._digest.update(data)
        return self._stream.write(data)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class Reader(FileSystemReader):
    """DCP's reader, given the index already read and checked (`read_metadata`)."""

    def __init__(self, path: os.PathLike, index: dcp_metadata.Metadata, **extra):
        super().__init__(path, **extra)
        self.index = index

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        return self.index


@functools.cache
def _remote_classes():
    """Writer and Reader on torch's fsspec storage (imported only when a URL is used)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    class RemoteWriter(Writer, FsspecWriter):
        def prepare_global_plan(self, plans):
            # The coordinator, before any rank writes: what an earlier attempt at this step left
            # (an upload cut short: no meta.json) goes, so no object of it mixes with these.
            from ddpgpt.checkpoint import location
            location.remove_tree(location.at(str(self.path)))
            return super().prepare_global_plan(plans)

    class RemoteReader(Reader, FsspecReader):
        def read_data(self, plan, planner):
            # every range the plan needs fetched concurrently, then read from memory
            from ddpgpt.checkpoint import ranges
            return ranges.read_data(self, plan, planner, super().read_data)

    return RemoteWriter, RemoteReader


def writer_for(path) -> Writer:
    """DCP's writer for a checkpoint directory: a local one, or a prefix in object storage (a
    checkpoint.location.Remote)."""
    if hasattr(path, "url"):
        return _remote_classes()[0](path.url, remote=True)
    return Writer(path)


def reader_for(path, index: dcp_metadata.Metadata) -> Reader:
    if hasattr(path, "url"):
        return _remote_classes()[1](path.url, index, use_listings_cache=False,
                                    **storage.client_options(path.url))
    return Reader(path, index)


_ALLOWED = {(c.__module__, c.__name__) for c in (
    dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo, torch.Size,
    pathlib.PosixPath)} | {("torch.serialization", "_get_layout")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch"
                                          and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's index")


def parse_index(data: bytes) -> dcp_metadata.Metadata:
    """DCP's `.metadata`, admitting only its own classes (no code runs while it is read)."""
    index = _IndexUnpickler(io.BytesIO(data)).load()
    if not isinstance(index, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"an index holds a Metadata, not a {type(index).__name__}")
    return index


def failures(error: BaseException) -> list[tuple[int | None, BaseException]]:
    """(rank, exception) behind a DCP failure: its CheckpointException carries each failed rank's
    own (gathered to every rank); anything else is (None, error)."""
    if isinstance(error, CheckpointException):
        return sorted(((rank, exc) for rank, (exc, _) in error.failures.items()),
                      key=lambda pair: pair[0])
    return [(None, error)]


# ---- save and load ---------------------------------------------------------------------------

def _alone_is_meant() -> None:
    """Without a process group (one process, `eval`, `export`) DCP warns at every save and load
    that it assumes a single process: true here by design. That one message is silenced, for
    every thread (the background save's too); every other warning still shows. Set at each call:
    whoever saved the filters before (pytest, a caller's catch_warnings) may restore them."""
    warnings.filterwarnings("ignore", category=UserWarning, message=(
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
        r"(save|load) in a single process"))


def save(state: dict[str, Pieces], path: os.PathLike, group, asynchronous: bool = False,
         stager=None, writer: Writer | None = None):
    """Writes this rank's chunks into `path` (collective over `group`; None: this process alone).
    Returns the Writer (`writer`, if given: the caller keeps its `error` when this raises), whose
    `files` are filled once the write is done. `asynchronous`: returns (writer, future) at once,
    after `stager` has copied the state; the write goes on in a thread."""
    writer = writer or writer_for(path)
    _alone_is_meant()
    kwargs = dict(storage_writer=writer, planner=SavePlanner(), process_group=group,
                  no_dist=group is None)
    if asynchronous:
        return writer, dcp.async_save(state, async_stager=stager, **kwargs)
    dcp.save(state, **kwargs)
    return writer


def load(targets: dict[str, Pieces], path: os.PathLike, index: dcp_metadata.Metadata,
         group) -> None:
    """Reads into `targets` in place, each rank what it holds (collective over `group`)."""
    _alone_is_meant()
    dcp.load(targets, storage_reader=reader_for(path, index), planner=LoadPlanner(),
             process_group=group, no_dist=group is None)


def read_whole(path: os.PathLike, index: dcp_metadata.Metadata, prefix: str
               ) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with `prefix`, whole, on this process alone (the name
    without the prefix -> tensor): what a consumer of the weights needs, and only that."""
    out, targets = {}, {}
    for name, md in index.state_dict_metadata.items():
        if name.startswith(prefix) and isinstance(md, dcp_metadata.TensorStorageMetadata):
            out[name[len(prefix):]] = t = torch.empty(md.size, dtype=md.properties.dtype)
            targets[name] = whole(t)
    load(targets, path, index, None)
    return out
