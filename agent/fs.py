"""Private directories and files on a shared host: nothing another local account can squat, swap or plant.

Sockets and staging (users' KV) live in directories such as
``/tmp/gpuckpt-$UID`` or ``/dev/shm/gpuckpt-…``, where any local user may
create a name first. Every directory gpuckpt uses is therefore *created*
with a mode that shuts others out, and an existing one is *adopted* only
when :func:`check_dir` passes:

- it is a real directory (not a symlink), owned by a trusted account — this
  user, root, or (with a shared group) an account in that group;
- no access bits for others; without a shared group, none for the group
  either (mode 0700); with one, its group is that group;
- every directory above it (after resolving the path) is owned by root or a
  trusted account and not writable by others, unless it is sticky (``/tmp``,
  ``/dev/shm``: there nobody can rename or delete what they do not own).

A file another process names (a page file in a connector's reply or an
agent's offer) is opened with :func:`open_checked`: it must lie directly in
the directory it is expected in, is opened with ``O_NOFOLLOW``, and the
open descriptor is checked — a regular file with one link, owned by a
trusted account, not accessible to others — before a byte is read.

The shared group is the two-account setup (see ``docs/agent.md``): worker
and agent as different users sharing a group for the connector socket and
the staging directory, so that the worker cannot read the agent's key.
No vLLM import here.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from ckpt.errors import ConfigError


class UnsafePath(ConfigError):
    """A directory or file that another account could have created, replaced or planted."""


@dataclass(frozen=True)
class Trust:
    """Who may own what gpuckpt adopts: this user and root; with a shared ``gid``, also any account
    for an object of that group (only members and root can give an object that group, or write
    where the group's 2770 directories let them: an outsider cannot)."""

    gid: int | None = None
    group: str | None = None

    @classmethod
    def of(cls, group: str | int | None = None) -> Trust:
        """``group``: the shared group's name or gid (a gid need not have a name here)."""
        if group is None:
            return cls()
        if isinstance(group, int) or (isinstance(group, str) and group.isdigit()):
            gid = int(group)
            try:
                return cls(gid, grp.getgrgid(gid).gr_name)
            except KeyError:
                return cls(gid, str(gid))
        try:
            return cls(grp.getgrnam(group).gr_gid, group)
        except KeyError:
            raise ConfigError(f"shared group {group!r} does not exist") from None

    def owner_ok(self, uid: int, gid: int | None = None) -> bool:
        return uid in (os.getuid(), 0) or (self.gid is not None and gid == self.gid)

    def describe(self) -> str:
        return "this user or root" + (f", or group {self.group}" if self.gid is not None else "")


def _mode(m: int) -> str:
    return f"{stat.S_IMODE(m):04o}"


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_ancestors(path: Path, trust: Trust) -> None:
    """Every directory above ``path`` (resolved) is owned by root or a trusted account and is not
    writable by others unless sticky: else another account could replace ``path`` itself."""
    real = Path(os.path.realpath(path.parent))
    for d in (real, *real.parents):
        st = os.lstat(d)
        if not trust.owner_ok(st.st_uid, st.st_gid):
            raise UnsafePath(
                f"{d} (above {path}) is owned by {_owner(st.st_uid)}, not {trust.describe()}: "
                f"that account could replace {path}; refusing to use it"
            )
        writable_by_others = st.st_mode & (stat.S_IWOTH | (0 if trust.gid == st.st_gid else stat.S_IWGRP))
        if writable_by_others and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(
                f"{d} (above {path}) is writable by other accounts (mode {_mode(st.st_mode)}, not sticky): "
                f"they could replace {path}; refusing to use it"
            )


def check_dir(path: str | os.PathLike[str], trust: Trust | None = None, *, shared: bool = False) -> Path:
    """Raise :class:`UnsafePath`, naming ``path`` and why, unless it may be adopted (see the module doc).

    ``shared``: the directory is shared with the trust's group (mode 0770 at most, that group's);
    otherwise it is private (0700 at most)."""
    trust = trust or Trust.of()
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise UnsafePath(f"directory {p} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{p} is a symlink, not a directory; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{p} is not a directory")
    if not trust.owner_ok(st.st_uid, st.st_gid):
        raise UnsafePath(
            f"directory {p} is owned by {_owner(st.st_uid)}, not {trust.describe()}: "
            f"another account created it first (squatting?); refusing to use it — remove it"
        )
    allowed = 0o7770 if shared else 0o7700
    if stat.S_IMODE(st.st_mode) & ~allowed:
        raise UnsafePath(
            f"directory {p} has mode {_mode(st.st_mode)}: other accounts could plant or read files in it "
            f"(at most {'2770' if shared else '0700'}); refusing to use it — remove it or fix its mode"
        )
    if shared and trust.gid is not None and st.st_gid != trust.gid:
        raise UnsafePath(f"directory {p} belongs to group {st.st_gid}, not the shared group {trust.group}")
    check_ancestors(p, trust)
    return p


def ensure_dir(path: str | os.PathLike[str], trust: Trust | None = None) -> Path:
    """Create ``path`` (and missing parents) shut to others, or adopt it if :func:`check_dir` passes.

    Private (mode 0700) without a shared group; with one (``trust.group``),
    mode 2770 and that group, so that files made in it are the group's too.
    An existing directory is never chmod-ed into shape: one another account
    could have written to is refused, naming it.
    """
    trust = trust or Trust.of()
    p = Path(path)
    shared = trust.gid is not None
    missing: list[Path] = []
    for d in (p, *p.parents):
        if os.path.lexists(d):
            break
        missing.append(d)
    if missing:
        check_ancestors(missing[-1], trust)  # nothing is made where another account could swap it
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # made meanwhile: judged below like any existing directory
        if shared:
            os.chown(d, -1, trust.gid)  # type: ignore[arg-type]
            os.chmod(d, 0o2770)  # noqa: S103 - the shared group only, setgid so files stay its
        else:
            os.chmod(d, 0o700)  # whatever the umask
    return check_dir(p, trust, shared=shared)


def check_fd(fd: int, name: str | os.PathLike[str], trust: Trust) -> os.stat_result:
    """Check an open file (not its path, which could be swapped): a regular file with one link, owned
    by a trusted account, with no access for others; returns its ``fstat``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{name} is not a regular file")
    if st.st_nlink != 1:
        raise UnsafePath(f"{name} has {st.st_nlink} links: a hard link to another file? refusing to read it")
    if not trust.owner_ok(st.st_uid, st.st_gid):
        raise UnsafePath(f"{name} is owned by {_owner(st.st_uid)}, not {trust.describe()}; refusing to read it")
    if st.st_mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise UnsafePath(f"{name} has mode {_mode(st.st_mode)} (others could read or change it); refusing it")
    return st


def open_checked(
    path: str | os.PathLike[str], *, directory: str | os.PathLike[str] | None, trust: Trust, flags: int = os.O_RDONLY
) -> int:
    """Open a file another process named: it must be directly in ``directory`` (``None``: in a
    directory :func:`check_dir` accepts), not a symlink, and pass :func:`check_fd`. Returns the fd."""
    p = Path(path)
    parent = Path(os.path.realpath(p.parent))
    if directory is not None:
        if parent != Path(os.path.realpath(directory)):
            raise UnsafePath(f"{p} is not in the staging directory {directory}; refusing to read it")
    else:
        check_dir(parent, trust, shared=trust.gid is not None)
    try:
        # O_NONBLOCK: a FIFO (or a device) put in a page file's place must not hold this open() —
        # and with it every checkpoint, the final one too — until someone writes to it
        fd = os.open(parent / p.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise UnsafePath(f"{p} is a symlink; refusing to follow it") from None
        if exc.errno == 6:  # ENXIO: a FIFO opened for writing with no reader
            raise UnsafePath(f"{p} is not a regular file (a FIFO?); refusing it") from None
        raise
    try:
        check_fd(fd, p, trust)  # a regular file, else refused
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_socket_dir(path: str | os.PathLike[str], trust: Trust | None = None) -> Path:
    """The directory a socket is made in: created like :func:`ensure_dir`, or adopted when no
    untrusted account can write to it or to any directory above it (reading it is harmless: a
    socket's own mode guards it)."""
    trust = trust or Trust.of()
    p = Path(path)
    if not os.path.lexists(p):
        return ensure_dir(p, trust)
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"socket directory {p} is not a directory (a symlink?); refusing to use it")
    if not trust.owner_ok(st.st_uid, st.st_gid):
        raise UnsafePath(
            f"socket directory {p} is owned by {_owner(st.st_uid)}, not {trust.describe()}: another account "
            f"created it first (squatting?); refusing to use it — remove it"
        )
    group_ok = trust.gid is not None and st.st_gid == trust.gid
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not group_ok):
        raise UnsafePath(
            f"socket directory {p} has mode {_mode(st.st_mode)}: other accounts could replace the socket; "
            f"refusing to use it"
        )
    check_ancestors(p, trust)
    return p


def check_socket(path: str | os.PathLike[str], trust: Trust | None = None) -> None:
    """Before talking to a socket: it is a socket owned by a trusted account, closed to others, in a
    directory no untrusted account can write to — else someone else may be answering on it."""
    trust = trust or Trust.of()
    p = Path(path)
    st = os.lstat(p)  # FileNotFoundError: not there (yet)
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePath(f"{p} is not a socket (a symlink or a planted file?); refusing to use it")
    if not trust.owner_ok(st.st_uid, st.st_gid):
        raise UnsafePath(
            f"socket {p} is owned by {_owner(st.st_uid)}, not {trust.describe()}: another account may be "
            f"answering on it; refusing to talk to it"
        )
    if st.st_mode & stat.S_IRWXO:
        raise UnsafePath(f"socket {p} has mode {_mode(st.st_mode)}: open to other accounts; refusing to use it")
    ensure_socket_dir(p.parent, trust)
