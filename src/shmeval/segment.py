"""Create, attach and unlink the shared segment; process liveness; cleanup.

A segment is one POSIX shared-memory object named
``/shmeval-<owner pid>-<random>``, mode 0600, so that stale ones are easy to
find (``/dev/shm/shmeval-*``) and to attribute to a process.  It is the only
named object shmeval creates: the doorbells are futex words inside it, so
there are no named semaphores (``/dev/shm/sem.*``) to leak or clean up.
"""
from __future__ import annotations

import os
import secrets
import stat
import struct
from typing import NamedTuple, Optional

import posix_ipc

from . import _ring
from .errors import SegmentError
from .spec import Spec

PREFIX = "shmeval-"
SHM_DIR = "/dev/shm"


def new_name() -> str:
    return f"/{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


class Namespaces(NamedTuple):
    """A process's pid and time namespaces: the inode numbers of
    /proc/self/ns/pid and /proc/self/ns/time (0 when unknown: no /proc, or
    a kernel without time namespaces)."""
    pid: int
    time: int


def _ns_inode(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def namespaces() -> Namespaces:
    """This process's namespaces.  Pids and /proc start times, by which
    shmeval tells a live process from a dead one, mean something only
    within one pid namespace and one time namespace; the segment records
    its creator's, and every process that uses it must share them."""
    return Namespaces(_ns_inode("pid"), _ns_inode("time"))


def _foreign(theirs: Namespaces, ours: Namespaces) -> Optional[str]:
    """Which namespace differs ("pid" or "time"), None when both agree (or
    either side is unknown)."""
    for kind in ("pid", "time"):
        a, b = getattr(theirs, kind), getattr(ours, kind)
        if a and b and a != b:
            return kind
    return None


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"address must be a str like '/shmeval-123-ab12...', got {name!r}")
    if not name.startswith("/"):
        name = "/" + name
    if "/" in name[1:] or len(name) > 255:
        raise SegmentError(f"{name!r} is not a valid shmeval address")
    return name


def _check_fits(size: int, spec: Spec, cache_entries: int) -> None:
    """ValueError when a segment of size bytes cannot live in this machine's
    memory: more than /dev/shm has free, or than the machine's RAM (a
    tmpfs file that big is accepted, and the process dies of SIGBUS once it
    touches the part that does not fit)."""
    limits = []
    try:
        st = os.statvfs(SHM_DIR)
        limits.append((st.f_bavail * st.f_frsize, f"the {{}} free in {SHM_DIR}"))
    except OSError:
        pass
    try:
        limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                       "this machine's {} of memory"))
    except (OSError, ValueError):
        pass
    for limit, what in limits:
        if size > limit:
            whose = (f"a cache of {cache_entries} entries of "
                     f"{_ring.cache_entry_bytes(spec.out_bytes)} bytes" if cache_entries
                     else "the segment")
            raise ValueError(f"{whose} needs {_gib(size)} in all, more than "
                             f"{what.format(_gib(limit))}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def create(spec: Spec, name: Optional[str] = None, replicas: int = 1,
           servers: int = 1, cache_entries: int = 0) -> tuple["_ring.Segment", str]:
    """Creates and formats a new segment for spec, served by `replicas`
    model replicas from `servers` serving threads in all, with an
    evaluation cache of `cache_entries` entries (0: none); returns (segment,
    name).

    First removes this user's stale segments (see :func:`cleanup_own_stale`),
    so that processes killed without closing do not pile up in /dev/shm."""
    name = _check_name(name) if name else new_name()
    size = _ring.segment_size(spec.in_bytes, spec.out_bytes, spec.max_clients,
                              spec.slots_per_client, spec.max_batch, replicas, servers,
                              cache_entries)
    cleanup_own_stale()
    _check_fits(size, spec, cache_entries)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    except posix_ipc.ExistentialError:
        raise SegmentError(f"segment {name} already exists") from None
    ns = namespaces()
    try:
        seg = _ring.Segment.create(shm.fd, size, spec.in_bytes, spec.out_bytes,
                                   spec.max_clients, spec.slots_per_client, spec.max_batch,
                                   replicas, servers, spec.to_json(), os.getpid(), ns.pid,
                                   ns.time, name, cache_entries,
                                   process_starttime(os.getpid()) or 0)
    except BaseException:
        shm.close_fd()
        unlink(name)
        raise
    shm.close_fd()
    seg.set_spec(spec)
    return seg, name


def attach(name: str, expect: Optional[Spec] = None) -> tuple["_ring.Segment", Spec]:
    """Maps an existing segment and validates it (magic, layout version, spec,
    namespaces).

    Raises SegmentError saying what is wrong: missing, not accessible, not a
    shmeval segment, another layout version, corrupt, another spec, or
    created in another pid or time namespace.
    """
    name = _check_name(name)
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise SegmentError(
            f"no shmeval segment named {name}: the evaluator is not running "
            "(or was closed)") from None
    except posix_ipc.PermissionsError:
        raise SegmentError(f"permission denied on segment {name}: {_whose(name)}") from None
    try:
        seg = _ring.Segment.attach(shm.fd, shm.size, name)
    finally:
        shm.close_fd()
    kind = _foreign(Namespaces(seg.pid_ns, seg.time_ns), namespaces())
    if kind is not None:
        raise SegmentError(
            f"segment {name} was created in another {kind} namespace than this process's: "
            f"shmeval tells live processes from dead ones by pid and start time, so every "
            f"process using an evaluator must share its {kind} namespace (Docker: "
            f"--{kind}=container:<the evaluator's container>; Kubernetes: "
            f"shareProcessNamespace: true for the pid namespace)")
    try:
        spec = Spec.from_json(seg.spec)
    except Exception as e:  # anything a hostile spec text can provoke
        raise SegmentError(f"segment {name} holds an unreadable spec: "
                           f"{type(e).__name__}: {e}") from None
    params = seg.params
    if (params["in_bytes"], params["out_bytes"], params["max_clients"],
            params["slots_per_client"], params["max_batch"]) != (
            spec.in_bytes, spec.out_bytes, spec.max_clients, spec.slots_per_client,
            spec.max_batch):
        raise SegmentError(f"segment {name}: header parameters disagree with its spec")
    if expect is not None and expect.to_json() != spec.to_json():
        raise SegmentError(
            f"segment {name} serves another spec: expected {expect.to_json().decode()}, "
            f"found {spec.to_json().decode()}")
    seg.set_spec(spec)
    return seg, spec


def _user(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _whose(name: str) -> str:
    """Why a segment is not ours to open: its owner and our user."""
    me = _user(os.geteuid())
    try:
        st = os.stat(SHM_DIR + name)
    except OSError:
        return f"this process (running as {me}) may not open it"
    if st.st_uid != os.geteuid():
        return (f"it belongs to {_user(st.st_uid)} and this process runs as {me}; "
                "shmeval segments are created mode 0600, so only processes of the "
                "evaluator's user can attach")
    return (f"it has mode {st.st_mode & 0o777:04o} although it belongs to this "
            f"process's user ({me})")


def unlink(name: str) -> bool:
    """Removes the segment's name; returns False when it was already gone.
    Raises posix_ipc.PermissionsError for another user's segment (the sticky
    /dev/shm lets only its owner, or root, remove it)."""
    try:
        posix_ipc.unlink_shared_memory(_check_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


# ---------------------------------------------------------------- liveness

def process_starttime(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of a live process, None if the
    process does not exist or is a zombie.  Paired with the pid it identifies a
    process even after its pid is reused."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:  # hidepid: assume alive, cannot tell
        return 0
    # The command name (field 2) may contain spaces and ')': split after the
    # last ')'.  Then field 3 is the state and field 22 the start time.
    fields = data[data.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


def is_alive(pid: int, starttime: int = 0) -> bool:
    st = process_starttime(pid)
    if st is None:
        return False
    return starttime == 0 or st == 0 or st == starttime


# ---------------------------------------------------------------- cleanup

_MAGIC = 0x314C4156454D4853   # ring.h SHM_MAGIC, "SHMEVAL1"
# ring.h shm_header, read without mapping the segment (ring.h asserts the
# offsets): magic u64 @0, layout_version u32 @8, owner_pid i32 @72, pid_ns
# u64 @80, time_ns u64 @88, owner_starttime u64 @96.
_HEADER = struct.Struct("<QI60xi4xQQQ")


class _Header(NamedTuple):
    owner_pid: int
    ns: Optional[Namespaces]  # None: a layout that does not record them
    owner_starttime: int = 0  # 0: unknown (or a layout without it)


def _name_pid(entry: str) -> int:
    """The pid in ``shmeval-<pid>-...``, 0 when the name carries none."""
    try:
        return max(0, int(entry[len(PREFIX):].split("-", 1)[0]))
    except ValueError:
        return 0


def _read_header(path: str) -> Optional[_Header]:
    """The creator as recorded in a formatted segment's header; None when it
    cannot be read (another user's segment, not formatted yet, foreign)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        head = os.pread(fd, _HEADER.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < 12 or struct.unpack_from("<Q", head)[0] != _MAGIC:
        return None
    version = struct.unpack_from("<I", head, 8)[0]
    if version != _ring.LAYOUT_VERSION or len(head) < _HEADER.size:
        # An older layout: its owner pid where layouts up to 3 kept it, no
        # namespaces.
        old = 64
        pid = struct.unpack_from("<i", head, old)[0] if len(head) >= old + 4 else 0
        return _Header(max(0, int(pid)), None)
    _, _, pid, pid_ns, time_ns, starttime = _HEADER.unpack(head)
    return _Header(max(0, pid), Namespaces(pid_ns, time_ns), starttime)


def _inspect(entry: str) -> Optional[dict[str, object]]:
    path = os.path.join(SHM_DIR, entry)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None                  # removed meanwhile
    if not stat.S_ISREG(st.st_mode):
        return None
    # The header says who created a formatted segment (a name given with
    # Evaluator(name=...) need not hold the creator's pid); otherwise the name.
    head = _read_header(path)
    if head is None and not entry.startswith(PREFIX):
        return None                  # another program's (or another user's: unreadable)
    pid = (head.owner_pid if head else 0) or _name_pid(entry)
    # A creator in another pid or time namespace cannot be judged from here:
    # its pid means another process, or none, in ours.
    foreign = head is not None and head.ns is not None and \
        _foreign(head.ns, namespaces()) is not None
    return {"address": "/" + entry, "owner_pid": pid,
            # An owner we cannot identify counts as alive: never removed.
            # With its start time the owner is told from a later process
            # of the same pid (also in a namespace whose inode number was
            # reused, which the namespace check cannot see).
            "owner_alive": pid == 0 or foreign or
            is_alive(pid, head.owner_starttime if head else 0),
            "foreign_namespace": foreign, "uid": st.st_uid, "bytes": st.st_size}


def list_segments() -> list[dict[str, object]]:
    """Every shmeval segment in /dev/shm (named shmeval-..., or given another
    name with ``name=`` and known by the magic number of its header, where
    this user can read it): address, owner pid (0 when unknown),
    whether the owner is alive (an owner that cannot be judged from here --
    unknown, or in another pid or time namespace -- counts as alive), whether
    it was created in another namespace, the segment's uid and its size."""
    out: list[dict[str, object]] = []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return out
    for entry in names:
        info = _inspect(entry)
        if info is not None:
            out.append(info)
    return out


def cleanup_stale(dry_run: bool = False, only_mine: bool = False,
                  errors: Optional[dict[str, str]] = None) -> list[str]:
    """Unlinks segments whose owner process is dead; returns their addresses.

    only_mine: only segments of this process's user.  A segment that cannot
    be removed (another user's, without root) is skipped and, when errors is
    given, recorded there as {address: reason}.  Liveness is judged by pid
    and start time in this pid namespace, so segments created in another
    pid or time namespace (another container sharing /dev/shm) are never
    removed; a dead owner whose pid was reused by a live process keeps its
    segment."""
    removed = []
    me = os.geteuid()
    for s in list_segments():
        if s["owner_alive"] or (only_mine and s["uid"] != me):
            continue
        address = str(s["address"])
        if dry_run:
            removed.append(address)
            continue
        try:
            if unlink(address):
                removed.append(address)
        except (posix_ipc.Error, OSError) as e:
            if errors is not None:
                uid = s["uid"]
                owner = _user(uid) if isinstance(uid, int) else str(uid)
                errors[address] = f"{type(e).__name__}: {e} (the segment belongs to {owner})"
    return removed


def cleanup_own_stale() -> list[str]:
    """Removes this user's segments whose owner process is dead, quietly:
    called before every create(), it never raises (a failed cleanup must not
    fail the evaluator being created).  Costs one listdir of /dev/shm and a
    /proc lookup per shmeval segment; segments of live owners, of owners it
    cannot identify and of other users are never touched."""
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    me, my_pid = os.geteuid(), os.getpid()
    for entry in entries:
        try:
            if not entry.startswith(PREFIX):
                continue
            name_pid = _name_pid(entry)
            if name_pid == my_pid or (name_pid and is_alive(name_pid)):
                continue             # the common case: a live evaluator's
            s = _inspect(entry)
            if s is None or s["owner_alive"] or s["uid"] != me:
                continue
            if unlink(str(s["address"])):
                removed.append(str(s["address"]))
        except Exception:  # noqa: BLE001 - best effort, never fails create()
            continue
    return removed
