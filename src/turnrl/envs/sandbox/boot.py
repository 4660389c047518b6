"""The setup helper the sandbox runs in every call (`BOOT`, written to the call's staging folder
as boot.py): the namespaces, the read-only jail, the rlimits and the privilege drop, then the
program. It is the child's source, not code this process runs."""

# --------------------------------------------------------------------------------------------
# The setup helper. It runs as `python -I -S <stage>/boot.py args...` in its own session and:
#   P (this process):  unshare(namespaces) -> fork init -> wait for it, exit
#   init (pid 1 in the new pid namespace): mount jail, rlimits, drop privileges -> fork user
#       -> wait (reaping orphans) -> report the user's wait status on the status fd -> exit,
#       which makes the kernel kill everything left in the pid namespace.
#   user: runs the program in a fresh __main__ module.
# In probe mode ("0" strict flag) failed steps are skipped and the steps that worked are
# reported ("L..." line); in strict mode any failed step aborts the run ("E..." line), so a run
# never silently gets weaker isolation than sandbox_capabilities() reported.
# --------------------------------------------------------------------------------------------
BOOT = r'''
import os, sys
A = sys.argv
SFD = int(A[1]); WANT = set(filter(None, A[2].split(","))); STRICT = A[3] == "1"
UID = int(A[4]); GID = int(A[5]); STAGE = A[6]; HIDE = A[7]
TIMEOUT = float(A[8]); CPU = int(A[9]); MEM = int(A[10]); NPROC = int(A[11])
FSIZE = int(A[12]); TMPFS = int(A[13]); NEED_FS_FOR_DROP = A[14] == "1"
DONE = []

def report(line):
    try:
        os.write(SFD, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass

def step(name, fn):
    if name not in WANT:
        return False
    try:
        fn()
    except BaseException as e:
        if STRICT:
            report("E%s: %s: %s" % (name, type(e).__name__, e))
            os._exit(111)
        return False
    DONE.append(name)
    return True

with open(os.path.join(STAGE, "main.py"), "rb") as f:
    SRC = f.read()
os.unlink(A[0])  # this script: already compiled, and not for the program to see

def load_libc():
    # The C core of ctypes (~0.5 ms to import) instead of the ctypes package (~4 ms).
    import _ctypes as C
    T = {}
    for code in "iIlLQzP":
        T[code] = type("c_" + code, (C._SimpleCData,), {"_type_": code})
    fn_type = type("F", (C.CFuncPtr,), {"_flags_": C.FUNCFLAG_CDECL | C.FUNCFLAG_USE_ERRNO,
                                        "_restype_": T["i"]})
    handle = C.dlopen(None, 2)  # RTLD_NOW
    def fn(name, *argtypes):
        f = fn_type(C.dlsym(handle, name))
        if argtypes:
            f.argtypes = [T[a] for a in argtypes]
        return f
    class L:
        pass
    L.C, L.T = C, T
    L.unshare = fn("unshare", "i")
    L.mount = fn("mount", "z", "z", "z", "L", "z")
    L.prctl = fn("prctl", "i", "L", "L", "L", "L")
    L.syscall = fn("syscall")
    L.capset = fn("capset", "P", "P")
    return L

libc = load_libc() if WANT & {"userns", "mntns", "netns", "pidns", "ipcns", "nnp"} else None

def ck(r, what):
    if r != 0:
        e = libc.C.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    ck(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount %s" % dst)

def unshare(flag):
    return lambda: ck(libc.unshare(flag), "unshare")

def userns():
    ck(libc.unshare(0x10000000), "unshare(CLONE_NEWUSER)")
    uid, gid = os.getuid(), os.getgid()
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                       ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)

if step("userns", userns) or os.geteuid() == 0:
    step("mntns", unshare(0x00020000))
    step("netns", unshare(0x40000000))
    step("pidns", unshare(0x20000000))
    step("ipcns", unshare(0x08000000))

def flush_all():
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if s is not None:
                s.flush()
        except Exception:
            pass

def run_user():
    os.close(SFD)
    if libc is not None:
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: a normal /proc/self for the program
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    try:
        sys.stdout.reconfigure(line_buffering=True)  # partial output survives a timeout
    except Exception:
        pass
    status = 0
    try:
        try:
            code = compile(SRC, "main.py", "exec", dont_inherit=True)
        except BaseException as e:
            sys.excepthook(type(e), e, None)
            raise SystemExit(1)
        try:
            exec(code, main.__dict__)
        except SystemExit:
            raise
        except BaseException as e:
            tb = e.__traceback__.tb_next if e.__traceback__ else None  # hide this frame
            sys.excepthook(type(e), e.with_traceback(tb), tb)
            raise SystemExit(1)
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            try:
                print(e.code, file=sys.stderr)
            except Exception:
                pass
            status = 1
    # What interpreter shutdown does that a program can observe, without the ~3 ms of
    # module teardown: join non-daemon threads, atexit handlers, flush (and let the program's
    # own objects go, which closes and flushes its files), exit.
    try:
        t = sys.modules.get("threading")
        if t is not None:
            t._shutdown()
        import atexit
        atexit._run_exitfuncs()
        flush_all()
        main.__dict__.clear()
        flush_all()
    except BaseException:
        pass
    os._exit(status & 0xFF)

def jail():
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
    MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do propagates to the host
    # Hide host folders (the project, /home, /run and its sockets, /root, ...) behind an empty
    # tmpfs, re-exposing only the interpreter's prefix; a top-level file behind an empty file.
    for n, spec in enumerate(filter(None, HIDE.split(";"))):
        hidden, *keep = spec.split("|")
        if not os.path.isdir(hidden):
            empty = os.path.join(STAGE, ".empty")
            open(empty, "w").close()
            mount(empty, hidden, None, MS_BIND)
            continue
        stashes = []
        for i, rel in enumerate(keep):
            stash = os.path.join(STAGE, ".stash%d_%d" % (n, i))
            os.mkdir(stash, 0o700)
            mount(os.path.join(hidden, rel), stash, None, MS_BIND | MS_REC)
            stashes.append((stash, rel))
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for stash, rel in stashes:
            target = os.path.join(hidden, rel)
            os.makedirs(target, 0o755, exist_ok=True)
            mount(stash, target, None, MS_MOVE)
            os.rmdir(stash)
    # Everything read-only: mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, {attr_set=RDONLY}).
    C, T = libc.C, libc.T
    attr = type("A", (C.Array,), {"_type_": T["Q"], "_length_": 4})(1, 0, 0, 0)
    r = libc.syscall(T["l"](442), T["i"](-100), T["z"](b"/"), T["I"](0x8000), C.byref(attr),
                     T["L"](32))
    if r != 0:  # older kernels: remount each mount, keeping its other flags
        import re
        with open("/proc/self/mountinfo") as f:
            points = [l.split()[4] for l in f]
        for p in points:
            p = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) if "\\" in p else p
            if not os.path.exists(p):
                continue  # under a hidden folder
            fl = os.statvfs(p).f_flag
            keep = fl & (MS_NOSUID | MS_NODEV | MS_NOEXEC) | (1024 if fl & 1024 else 0) | \
                (2048 if fl & 2048 else 0) | ((1 << 21) if fl & 4096 else 0)
            mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)
    # Fresh writable tmpfs: /tmp (the working directory and HOME) and /dev/shm.
    opts = "size=%dm,nr_inodes=16384,uid=%d,gid=%d" % (TMPFS, os.getuid() if UID < 0 else UID,
                                                       os.getgid() if GID < 0 else GID)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777," + opts)
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777," + opts)
    os.chdir("/tmp")
    with open("main.py", "wb") as f:  # for tracebacks with source lines
        f.write(SRC)

def limits():
    import resource
    R = resource
    for res, soft, hard in ((R.RLIMIT_CORE, 0, 0), (R.RLIMIT_CPU, CPU, CPU + 1),
                            (R.RLIMIT_AS, MEM, MEM), (R.RLIMIT_FSIZE, FSIZE, FSIZE),
                            (R.RLIMIT_NPROC, NPROC, NPROC)):
        if soft < 0:
            continue
        old_soft, old_hard = R.getrlimit(res)
        if old_hard != R.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        R.setrlimit(res, (soft, hard))

def drop_root():
    os.setgroups([])
    os.setgid(GID)
    os.setuid(UID)  # from uid 0 to non-zero: all capabilities are cleared too
    if os.getuid() != UID or os.geteuid() != UID:
        raise OSError("setuid did not stick")

def drop_caps():  # inside our user namespace: no capabilities left for the program
    C, T = libc.C, libc.T
    hdr = type("H", (C.Array,), {"_type_": T["I"], "_length_": 2})(0x20080522, 0)
    data = type("D", (C.Array,), {"_type_": T["I"], "_length_": 6})()
    ck(libc.capset(C.byref(hdr), C.byref(data)), "capset")

def proc():
    mount("proc", "/proc", "proc", 2 | 4 | 8)

def init_main():
    import _signal as S  # the C module: "signal" would import enum & co (~8 ms)
    if "mntns" in DONE:
        step("jail", jail)
        if "pidns" in DONE:
            step("proc", proc)
    step("rlimits", limits)
    if not NEED_FS_FOR_DROP or "jail" in DONE:
        step("drop", drop_root)
    if "userns" in DONE:
        step("capdrop", drop_caps)
    if libc is not None:
        step("nnp", lambda: ck(libc.prctl(38, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)"))
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL: die with P (after setuid)
    report("L" + ",".join(DONE))
    try:
        child = os.fork()
    except OSError as e:
        report("Estart: cannot fork the program (%s); max_processes=%d too low?" % (e, NPROC))
        os._exit(111)
    if child == 0:
        return True
    for s in (S.SIGINT, S.SIGTERM, S.SIGHUP, S.SIGQUIT, S.SIGUSR1, S.SIGUSR2, S.SIGPIPE):
        S.signal(s, S.SIG_IGN)
    def backstop(*_):  # the caller died or lost track of us: end the sandbox anyway
        report("T")
        if "pidns" not in DONE:
            os.killpg(0, 9)
        os._exit(0)
    S.signal(S.SIGALRM, backstop)
    S.alarm(int(TIMEOUT) + 3)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            report("E?: program vanished")
            break
        if pid == child:
            report("S%d" % status)
            break
    if "pidns" not in DONE:
        try:
            os.killpg(0, 9)  # leftovers in our process group (we are in it, too)
        except OSError:
            pass
    os._exit(0)

try:
    init = os.fork()
except OSError as e:
    report("Efork: %s" % e)
    os._exit(111)
if init == 0:
    if init_main():
        run_user()
else:
    while True:
        try:
            _, st = os.waitpid(init, 0)
            break
        except ChildProcessError:
            st = 0
            break
    os._exit(min(255, abs(os.waitstatus_to_exitcode(st))))
'''

ALL_LAYERS = ("userns", "mntns", "netns", "pidns", "ipcns", "jail", "proc", "rlimits", "drop",
              "capdrop", "nnp")
