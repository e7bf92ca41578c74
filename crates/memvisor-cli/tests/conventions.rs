//! The servers' back end conventions (issue 36), checked on the `memvisor` binary as a service
//! manager runs it: `--socket-path` and its alias `--socket`, `--fd N` with an inherited
//! listener, systemd socket activation (`LISTEN_FDS`), `--print-capabilities`, `READY=1` on
//! `$NOTIFY_SOCKET`, a live socket refused (and its server unharmed), a stale one replaced, a
//! file that is not a socket left alone, and `RUST_LOG`: module filters and a refused filter.
//! Nothing here needs root.

mod common;

use common::Dir;

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::proto::req;

const BIN: &str = env!("CARGO_BIN_EXE_memvisor");

/// A datagram socket standing in for systemd's notification socket.
struct Notify {
    sock: UnixDatagram,
    path: PathBuf,
}

impl Notify {
    fn new(dir: &Dir) -> Notify {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Notify { sock, path }
    }
    /// The next message, or None after 30 s (or another error of the socket, printed). A
    /// signal arriving during the wait (EINTR) does not end it.
    fn try_next(&self) -> Option<String> {
        let mut buf = [0u8; 256];
        loop {
            match self.sock.recv(&mut buf) {
                Ok(n) => return Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("NOTIFY_SOCKET stand-in {}: {e}", self.path.display());
                    return None;
                }
            }
        }
    }
    /// The next message, or panics after 30 s.
    fn next(&self) -> String {
        self.try_next()
            .expect("a message on NOTIFY_SOCKET within 30 s")
    }
}

/// A running server, stopped with SIGTERM (and reaped) on drop.
struct Server {
    child: Child,
    stderr: PathBuf,
}

impl Server {
    /// Starts `cmd` with NOTIFY_SOCKET and stderr to a file; returns once it said READY=1.
    fn start(mut cmd: Command, dir: &Dir, notify: &Notify) -> Server {
        let stderr = dir.join(&format!("stderr-{}.log", unique()));
        cmd.env("NOTIFY_SOCKET", &notify.path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap());
        let child = cmd.spawn().expect("start memvisor");
        let mut s = Server { child, stderr };
        let msg = notify.try_next();
        let exited = s.child.try_wait().unwrap();
        assert_eq!(msg.as_deref(), Some("READY=1"), "{exited:?}\n{}", s.log());
        s
    }
    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
    /// SIGTERM, then the exit status and stderr.
    fn stop(mut self) -> (std::process::ExitStatus, String) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill only sends a signal, to our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let status = wait_for(&mut self.child);
        (status, self.log())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn wait_for(child: &mut Child) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("memvisor did not stop within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn memvisor(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("RUST_LOG")
        .env_remove("MEMVISOR_LOG");
    c
}

/// Runs a command that must end by itself (print and exit, or refuse to start); one still
/// running after 20 s (a server that started instead of refusing) is killed and the test fails.
fn run(mut cmd: Command) -> Output {
    let base = std::env::temp_dir().join(format!(
        "memvisor-conv-run-{}-{}",
        std::process::id(),
        unique()
    ));
    let (out, err) = (base.with_extension("out"), base.with_extension("err"));
    cmd.stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap());
    let mut child = cmd.spawn().expect("run memvisor");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = std::fs::read_to_string(&err).unwrap_or_default();
            panic!("still running after 20 s (it should have ended by itself):\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = Output {
        status,
        stdout: std::fs::read(&out).unwrap(),
        stderr: std::fs::read(&err).unwrap(),
    };
    let _ = std::fs::remove_file(out);
    let _ = std::fs::remove_file(err);
    output
}

/// A vhost-user-blk back end answers on `path`: GET_FEATURES gets a reply.
fn answers_vhost_user(path: &Path) -> u64 {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    Client::from_stream(s)
        .get_u64(req::GET_FEATURES)
        .expect("GET_FEATURES answered")
}

/// In the child, before exec: `fd` becomes descriptor `at` (without close-on-exec).
fn pass_fd(cmd: &mut Command, fd: RawFd, at: RawFd) {
    // SAFETY: between fork and exec only dup2 and fcntl, which are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            // dup2 onto itself keeps close-on-exec: clear it instead.
            let r = if fd == at {
                libc::fcntl(fd, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, at)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `memvisor ARGS` started as systemd starts a socket-activated service: the listener as fd 3,
/// `LISTEN_FDS=1`, `LISTEN_PID` the server's own pid (a shell sets it, then execs memvisor).
fn activated(listener: &UnixListener, args: &[&str]) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" \"$@\"")
        .arg(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("MEMVISOR_LOG");
    pass_fd(&mut c, listener.as_raw_fd(), 3);
    c
}

#[test]
fn print_capabilities_prints_the_specifications_json_and_exits() {
    let dir = Dir::new("caps");
    // Other options are ignored: no disk, and a socket path that must not be created.
    let sock = dir.join("never.sock");
    let sock = sock.to_str().unwrap();
    for (args, want) in [
        (
            vec![
                "vhost-user-blk",
                "--print-capabilities",
                "--socket-path",
                sock,
            ],
            serde_json::json!({"type": "block", "features": ["read-only", "blk-file"]}),
        ),
        (
            vec!["serve", "--print-capabilities"],
            serde_json::json!({"type": "block", "features": []}),
        ),
        (
            vec!["vfio-user", "--print-capabilities", "--socket", sock],
            serde_json::json!({"type": "vfio-user", "device": "mvdma", "features": []}),
        ),
    ] {
        let out = run(memvisor(&args));
        assert!(out.status.success(), "{args:?}: {out:?}");
        let got: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("stdout is one JSON value");
        assert_eq!(got, want, "{args:?}");
        assert!(!Path::new(sock).exists(), "{args:?} created its socket");
    }
    // Every other option and argument is ignored (the specification): unknown options, stray
    // arguments, values clap refuses, options the specification calls incompatible, and no
    // --disk or device at all; still one JSON object and exit 0, and nothing served.
    let blk = serde_json::json!({"type": "block", "features": ["read-only", "blk-file"]});
    let serve = serde_json::json!({"type": "block", "features": []});
    let vfu = serde_json::json!({"type": "vfio-user", "device": "mvdma", "features": []});
    for (args, want) in [
        (
            vec!["vhost-user-blk", "--no-such-option", "--print-capabilities"],
            &blk,
        ),
        (
            vec![
                "vhost-user-blk",
                "--print-capabilities",
                "stray",
                "arguments",
            ],
            &blk,
        ),
        (
            vec!["vhost-user-blk", "--queues", "0", "--print-capabilities"],
            &blk,
        ),
        (
            vec![
                "vhost-user-blk",
                "--socket-path",
                sock,
                "--fd",
                "3",
                "--print-capabilities",
            ],
            &blk,
        ),
        (
            vec!["vhost-user-blk", "--print-capabilities", "--disk"],
            &blk,
        ),
        (
            vec![
                "serve",
                "--print-capabilities",
                "--blk",
                "queues=0",
                "--what",
            ],
            &serve,
        ),
        (
            vec![
                "serve",
                "--socket-path",
                sock,
                "--fd=3",
                "--print-capabilities",
                "x",
            ],
            &serve,
        ),
        (
            vec!["vfio-user", "-x", "--print-capabilities", "--fd", "nope"],
            &vfu,
        ),
    ] {
        let out = run(memvisor(&args));
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        let got: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not one JSON value ({e}): {out:?}"));
        assert_eq!(&got, want, "{args:?}");
        assert!(!Path::new(sock).exists(), "{args:?} created its socket");
    }
    // Without it, the same arguments are refused as before (the flag is what is ignored for).
    let out = run(memvisor(&[
        "vhost-user-blk",
        "--queues",
        "0",
        "--disk",
        "x",
    ]));
    assert_eq!(out.status.code(), Some(2), "{out:?}");

    // The features it claims exist: --blk-file and --read-only are options of vhost-user-blk.
    let help = String::from_utf8(run(memvisor(&["vhost-user-blk", "--help"])).stdout).unwrap();
    for flag in ["--blk-file", "--read-only", "--socket-path", "--fd <N>"] {
        assert!(help.contains(flag), "help lacks {flag}:\n{help}");
    }
}

#[test]
fn socket_path_serves_says_ready_and_is_removed_at_exit() {
    let dir = Dir::new("path");
    let notify = Notify::new(&dir);
    let (disk, sock) = (dir.disk(), dir.join("blk.sock"));
    let mut cmd = memvisor(&["vhost-user-blk", "--socket-path"]);
    cmd.arg(&sock).arg("--blk-file").arg(&disk);
    let server = Server::start(cmd, &dir, &notify);
    // READY=1 came once the socket listens: the back end answers at once.
    assert_ne!(answers_vhost_user(&sock), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert_eq!(notify.next(), "STOPPING=1");
    assert!(!sock.exists(), "the socket it bound is removed at exit");
}

#[test]
fn fd_serves_an_inherited_listener_and_leaves_its_path() {
    let dir = Dir::new("fd");
    let notify = Notify::new(&dir);
    let disk = dir.disk();
    let sock = dir.join("inherited.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let mut cmd = memvisor(&["vhost-user-blk", "--fd", "5", "--disk"]);
    cmd.arg(&disk);
    pass_fd(&mut cmd, listener.as_raw_fd(), 5);
    let server = Server::start(cmd, &dir, &notify);
    drop(listener); // only the server holds it now
    assert_ne!(answers_vhost_user(&sock), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        sock.exists(),
        "a socket memvisor did not bind is not removed"
    );

    // Descriptors that are not a listening Unix socket are refused, naming them.
    let file = std::fs::File::open(&disk).unwrap();
    let mut cmd = memvisor(&["vhost-user-blk", "--fd", "5", "--disk"]);
    cmd.arg(&disk);
    pass_fd(&mut cmd, file.as_raw_fd(), 5);
    let out = run(cmd);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--fd 5: descriptor 5 is not a socket"),
        "{err}"
    );
    let out = run(memvisor(&[
        "vhost-user-blk",
        "--fd",
        "7",
        "--disk",
        disk.to_str().unwrap(),
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("descriptor 7 is not open"),
        "{err}"
    );
}

#[test]
fn socket_activation_serves_the_socket_systemd_passed() {
    let dir = Dir::new("activation");
    let notify = Notify::new(&dir);
    let disk = dir.disk();
    // vhost-user-blk with no socket option: the one socket passed.
    let sock = dir.join("activated.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let mut cmd = activated(&listener, &["vhost-user-blk", "--disk"]);
    cmd.arg(&disk);
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&sock), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("systemd socket (fd 3"), "{log}");
    notify.next(); // STOPPING=1

    // serve: the passed socket is the one whose path a --blk names (the unit file and the
    // command line name the same path); the other device binds its own.
    let (sock2, own) = (dir.join("serve-a.sock"), dir.join("serve-b.sock"));
    let listener2 = UnixListener::bind(&sock2).unwrap();
    let a = format!("{},disk={}", sock2.display(), disk.display());
    // Its own image: one image served writable and read-only at once is refused (locks).
    let disk_b = dir.join("b.img");
    std::fs::File::create(&disk_b)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let b = format!("{},disk={},read-only=on", own.display(), disk_b.display());
    let cmd = activated(&listener2, &["serve", "--blk", &a, "--blk", &b]);
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&sock2), 0);
    assert_ne!(answers_vhost_user(&own), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        sock2.exists() && !own.exists(),
        "only what it bound is removed"
    );
    notify.next();

    // A passed socket no device names is a unit file and a command line that disagree.
    let stray = UnixListener::bind(dir.join("stray.sock")).unwrap();
    let c = format!("{},disk={}", dir.join("c.sock").display(), disk.display());
    let out = run(activated(&stray, &["serve", "--blk", &c]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("systemd passed sockets no device uses: fd 3"),
        "{err}"
    );
    assert!(err.contains("stray.sock"), "{err}");

    // vfio-user: the same, seen in its report (the connection came through the passed socket).
    let sock3 = dir.join("vfu.sock");
    let stats = dir.join("vfu.json");
    let listener3 = UnixListener::bind(&sock3).unwrap();
    let mut cmd = activated(&listener3, &["vfio-user", "--stats"]);
    cmd.arg(&stats);
    let server = Server::start(cmd, &dir, &notify);
    drop(UnixStream::connect(&sock3).unwrap());
    // The client's end: give the server a moment to accept and see it gone.
    let start = Instant::now();
    while !server.log().contains("client 1 gone") && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(report["socket"], sock3.display().to_string());
    assert_eq!(
        report["connections"].as_array().unwrap().len(),
        1,
        "{report}"
    );
}

#[test]
fn a_live_socket_is_refused_and_its_server_unharmed() {
    let dir = Dir::new("live");
    let notify = Notify::new(&dir);
    let (disk, sock) = (dir.disk(), dir.join("live.sock"));
    let mut cmd = memvisor(&["vhost-user-blk", "--socket"]);
    cmd.arg(&sock).arg("--disk").arg(&disk);
    let first = Server::start(cmd, &dir, &notify);
    // The servers refused below get an image of their own: the first holds disk.img's image
    // locks, which would refuse them before their socket is looked at.
    let disk = dir.join("other.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    for server in ["vhost-user-blk", "vfio-user"] {
        let mut cmd = memvisor(&[server, "--socket-path"]);
        cmd.arg(&sock).args(["--disk", disk.to_str().unwrap()]);
        if server == "vfio-user" {
            cmd = memvisor(&[server, "--socket-path"]);
            cmd.arg(&sock);
        }
        let out = run(cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{server}: {err}");
        assert!(
            err.contains(&format!("{} is in use", sock.display()))
                && err.contains("stop that server or choose another socket path"),
            "{server}: {err}"
        );
    }
    // serve refuses the same way, for a device's socket and for its control socket.
    let spec = format!("{},disk={}", sock.display(), disk.display());
    let out = run(memvisor(&["serve", "--blk", &spec]));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is in use"),
        "{out:?}"
    );
    let other = format!(
        "{},disk={}",
        dir.join("other.sock").display(),
        disk.display()
    );
    let mut cmd = memvisor(&["serve", "--blk", &other, "--control"]);
    cmd.arg(&sock);
    let out = run(cmd);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is in use"),
        "{out:?}"
    );
    assert!(!dir.join("other.sock").exists(), "nothing left half set up");
    // The first server still has its socket and serves.
    assert!(sock.exists());
    assert_ne!(answers_vhost_user(&sock), 0);
    let (status, log) = first.stop();
    assert!(status.success(), "{status:?}\n{log}");
}

#[test]
fn a_stale_socket_is_replaced_and_a_file_is_left_alone() {
    let dir = Dir::new("stale");
    let notify = Notify::new(&dir);
    let (disk, sock) = (dir.disk(), dir.join("stale.sock"));
    drop(UnixListener::bind(&sock).unwrap()); // the file stays, nothing listens
    assert!(sock.exists());
    let mut cmd = memvisor(&["vhost-user-blk", "--socket-path"]);
    cmd.arg(&sock).arg("--disk").arg(&disk);
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&sock), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("replacing a stale socket"), "{log}");

    let file = dir.join("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    let out = run(memvisor(&[
        "vhost-user-blk",
        "--socket-path",
        file.to_str().unwrap(),
        "--disk",
        disk.to_str().unwrap(),
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("{} exists and is not a socket", file.display())),
        "{err}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
}

#[test]
fn rust_log_filters_by_module_and_a_bad_filter_is_refused() {
    let dir = Dir::new("log");
    let notify = Notify::new(&dir);
    let (disk, sock) = (dir.disk(), dir.join("log.sock"));
    // Each filter, one connection, then the lines the log kept.
    let lines_with = |filter: &[(&str, &str)]| -> String {
        let mut cmd = memvisor(&["vhost-user-blk", "--socket-path"]);
        cmd.arg(&sock).arg("--disk").arg(&disk);
        for (var, value) in filter {
            cmd.env(var, value);
        }
        let server = Server::start(cmd, &dir, &notify);
        answers_vhost_user(&sock);
        let (status, log) = server.stop();
        assert!(status.success(), "{status:?}\n{log}");
        notify.next();
        log
    };
    // memvisor_cli::serve logs "serving", memvisor_vhost::backend "frontend connected".
    let serving = "INFO  memvisor_cli::serve] vhost-user-blk: serving";
    let connected = "INFO  memvisor_vhost::backend] vhost-user-blk: frontend connected";
    let all = lines_with(&[]);
    assert!(all.contains(serving) && all.contains(connected), "{all}");
    // Timestamps: [YYYY-MM-DDTHH:MM:SS.mmmZ LEVEL module] message.
    let first = all.lines().next().unwrap();
    assert!(
        first.starts_with("[20") && first.as_bytes()[11] == b'T' && first[..30].contains('Z'),
        "{first}"
    );
    let some = lines_with(&[("RUST_LOG", "warn,memvisor_cli=info")]);
    assert!(
        some.contains(serving) && !some.contains(connected),
        "{some}"
    );
    let none = lines_with(&[("RUST_LOG", "off")]);
    assert!(!none.contains("INFO"), "{none}");
    // MEMVISOR_LOG still works, says it is deprecated, and yields to RUST_LOG.
    let old = lines_with(&[("MEMVISOR_LOG", "warn")]);
    assert!(
        !old.contains("INFO") && old.contains("MEMVISOR_LOG is deprecated"),
        "{old}"
    );
    let both = lines_with(&[("MEMVISOR_LOG", "off"), ("RUST_LOG", "info")]);
    assert!(
        both.contains(serving) && !both.contains("deprecated"),
        "{both}"
    );

    for (var, bad, says) in [
        ("RUST_LOG", "memvisor=loud", "invalid logging spec 'loud'"),
        ("RUST_LOG", "debgu", "\"debgu\" is neither a level"),
        ("MEMVISOR_LOG", "info/a/b", "too many '/'s"),
    ] {
        let mut cmd = memvisor(&["vhost-user-blk", "--socket-path"]);
        cmd.arg(&sock).arg("--disk").arg(&disk).env(var, bad);
        let out = run(cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad}: {err}");
        assert!(
            err.contains(&format!("{var}={bad:?}")) && err.contains(says),
            "{err}"
        );
        assert!(!sock.exists(), "{bad}: refused before listening");
    }
}

#[test]
fn test_switches_are_not_options_of_the_product() {
    if cfg!(feature = "test-hooks") {
        // That build is the test server: its help names --record, a test kit switch.
        eprintln!(
            "skipped: test_switches_are_not_options_of_the_product: built with test-hooks; \
             the plain build (cargo test --workspace) checks the product"
        );
        return;
    }
    for (cmd, flag) in [
        ("vfio-user", "--test-ignore-unmap"),
        ("vhost-user-blk", "--test-no-dirty-log"),
    ] {
        let out = run(memvisor(&[cmd, flag, "--socket", "/nonexistent/x.sock"]));
        assert_eq!(out.status.code(), Some(2), "{cmd} {flag}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("unexpected argument '{flag}'")),
            "{err}"
        );
        let help = String::from_utf8(run(memvisor(&[cmd, "--help"])).stdout).unwrap();
        assert!(
            !help.to_lowercase().contains("test"),
            "{cmd} --help:\n{help}"
        );
    }
    // Not a signal: memvisor exits by itself with clap's usage error.
    let out = run(memvisor(&["vfio-user", "--test-ignore-unmap"]));
    assert_eq!(out.status.signal(), None);
}

/// A link named `memvisor-vhost-user-blk` / `memvisor-vfio-user` to the binary, in `dir`.
fn linked(dir: &Dir, name: &str) -> PathBuf {
    let link = dir.join(name);
    std::os::unix::fs::symlink(BIN, &link).unwrap();
    link
}

#[test]
fn the_program_name_picks_the_server_as_a_descriptors_binary_needs() {
    let dir = Dir::new("argv0");
    let notify = Notify::new(&dir);
    // What management software does with a descriptor's `binary`: --print-capabilities, then
    // the conventions' options alone, no subcommand.
    let blk = linked(&dir, "memvisor-vhost-user-blk");
    let out = run(program(&blk, &["--print-capabilities"]));
    assert!(out.status.success(), "{out:?}");
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["type"], "block", "{got}");
    let vfu = linked(&dir, "memvisor-vfio-user");
    let out = run(program(&vfu, &["--print-capabilities"]));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["type"], "vfio-user", "{got}");
    // It serves: --socket-path=PATH as libvirt writes it, --blk-file as the schema names it.
    let (disk, sock) = (dir.disk(), dir.join("argv0.sock"));
    let mut cmd = Command::new(&blk);
    cmd.arg(format!("--socket-path={}", sock.display()))
        .arg(format!("--blk-file={}", disk.display()))
        .env_remove("RUST_LOG");
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&sock), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    // Any other name is plain memvisor, which wants a subcommand.
    let other = linked(&dir, "vhost-user-blk");
    let out = run(program(&other, &["--print-capabilities"]));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// `memvisor ARGS` started as systemd starts a service with several named sockets: each
/// listener as fd 3, 4, ..., `LISTEN_FDS`, `LISTEN_FDNAMES` (colon-separated) and `LISTEN_PID`.
fn activated_named(listeners: &[(&UnixListener, &str)], args: &[&str]) -> Command {
    let names: Vec<&str> = listeners.iter().map(|(_, n)| *n).collect();
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "LISTEN_PID=$$ LISTEN_FDS={} LISTEN_FDNAMES={} exec \"$0\" \"$@\"",
            listeners.len(),
            names.join(":")
        ))
        .arg(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("MEMVISOR_LOG");
    let fds: Vec<RawFd> = listeners.iter().map(|(l, _)| l.as_raw_fd()).collect();
    // SAFETY: between fork and exec only dup and dup2, which are async-signal-safe. The
    // sources are first moved above the targets so that no dup2 overwrites a later source.
    unsafe {
        c.pre_exec(move || {
            let mut high = Vec::new();
            for &fd in &fds {
                let h = libc::fcntl(fd, libc::F_DUPFD, 100);
                if h < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                high.push(h);
            }
            for (i, &h) in high.iter().enumerate() {
                if libc::dup2(h, 3 + i as RawFd) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    c
}

#[test]
fn serve_takes_sockets_by_name_by_fd_and_by_its_own_socket_options() {
    let dir = Dir::new("fdnames");
    let notify = Notify::new(&dir);
    let img = |name: &str| {
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().set_len(1 << 20).unwrap();
        p.display().to_string()
    };
    let (a, b) = (img("a.img"), img("b.img"));
    // Two sockets passed, named after the devices' ids, given in the other order: each
    // device gets its own, whatever the order systemd passes them in.
    let (pa, pb) = (dir.join("named-a.sock"), dir.join("named-b.sock"));
    let (la, lb) = (
        UnixListener::bind(&pa).unwrap(),
        UnixListener::bind(&pb).unwrap(),
    );
    let blk_a = format!("id=disk-a,disk={a}");
    let blk_b = format!("id=disk-b,disk={b},read-only=on,serial=second");
    let stats = dir.join("named.json");
    let mut cmd = activated_named(
        &[(&lb, "disk-b"), (&la, "disk-a")],
        &["serve", "--blk", &blk_a, "--blk", &blk_b, "--stats"],
    );
    cmd.arg(&stats);
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&pa), 0);
    assert_ne!(answers_vhost_user(&pb), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    notify.next();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    // The report lists the blk devices in --blk order: disk-a, then disk-b.
    let sockets: Vec<&str> = report["blk"]
        .as_array()
        .unwrap_or_else(|| panic!("{report}"))
        .iter()
        .map(|d| d["socket"].as_str().unwrap())
        .collect();
    assert_eq!(
        sockets,
        [pa.display().to_string(), pb.display().to_string()],
        "{report}"
    );
    assert!(log.contains("systemd socket disk-a (fd 4"), "{log}");

    // The name decides where nothing else would: socket 4 is passed too but belongs to a
    // later device (fd=4), so without the name disk-a would have two to choose from.
    let (px, py) = (dir.join("x.sock"), dir.join("y.sock"));
    let (lx, ly) = (
        UnixListener::bind(&px).unwrap(),
        UnixListener::bind(&py).unwrap(),
    );
    let x = format!("id=disk-x,disk={a}");
    let y = format!("fd=4,disk={b},read-only=on,serial=y");
    let cmd = activated_named(
        &[(&lx, "disk-x"), (&ly, "other")],
        &["serve", "--blk", &x, "--blk", &y],
    );
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&px), 0);
    assert_ne!(answers_vhost_user(&py), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("systemd socket disk-x (fd 3"), "{log}");
    notify.next();

    // A name that matches no device's id, with two passed: refused, naming what was passed.
    let (pc, pd) = (dir.join("c.sock"), dir.join("d.sock"));
    let (lc, ld) = (
        UnixListener::bind(&pc).unwrap(),
        UnixListener::bind(&pd).unwrap(),
    );
    let c = format!("id=disk-c,disk={a}");
    let d = format!("{},disk={b}", pd.display());
    let out = run(activated_named(
        &[(&lc, "other"), (&ld, "x")],
        &["serve", "--blk", &c],
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("device disk-c names no socket") && err.contains("FileDescriptorName=disk-c"),
        "{err}"
    );
    // The only one not bound to another device's path is taken, whatever the order.
    let cmd = activated_named(
        &[(&ld, "x"), (&lc, "other")],
        &["serve", "--blk", &c, "--blk", &d],
    );
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&pc), 0);
    assert_ne!(answers_vhost_user(&pd), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    notify.next();
    // LISTEN_FDNAMES that does not count as many sockets as LISTEN_FDS is refused.
    let mut bad = activated(&lc, &["serve", "--blk", &c]);
    bad.env("LISTEN_FDNAMES", "a:b");
    let out = run(bad);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("LISTEN_FDNAMES=\"a:b\" names 2 sockets and LISTEN_FDS=1"),
        "{err}"
    );

    // fd=N on a device, and serve's own --fd / --socket-path for the one device that leaves
    // its socket out.
    let (pe, pf) = (dir.join("e.sock"), dir.join("f.sock"));
    let le = UnixListener::bind(&pe).unwrap();
    let e = format!("fd=6,disk={a}");
    let f = format!("disk={b},read-only=on,serial=f");
    let mut cmd = memvisor(&["serve", "--blk", &e, "--blk", &f, "--socket-path"]);
    cmd.arg(&pf);
    pass_fd(&mut cmd, le.as_raw_fd(), 6);
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&pe), 0);
    assert_ne!(answers_vhost_user(&pf), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    notify.next();
    assert!(
        !pf.exists() && pe.exists(),
        "only the socket it bound is removed"
    );
    let lf = UnixListener::bind(&pf).unwrap();
    let mut cmd = memvisor(&["serve", "--blk", &f, "--fd", "7"]);
    pass_fd(&mut cmd, lf.as_raw_fd(), 7);
    let server = Server::start(cmd, &dir, &notify);
    assert_ne!(answers_vhost_user(&pf), 0);
    let (status, log) = server.stop();
    assert!(status.success(), "{status:?}\n{log}");
    notify.next();
    // Refused: two devices leave their socket out, or none does, with --socket-path.
    for (blks, says) in [
        (vec![e.as_str(), d.as_str()], "every device names its own"),
        (
            vec![f.as_str(), "disk=/dev/null,id=g"],
            "2 devices leave it out",
        ),
    ] {
        let mut args = vec!["serve", "--socket-path", "/nonexistent/x.sock"];
        for b in &blks {
            args.extend(["--blk", b]);
        }
        let out = run(memvisor(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{blks:?}: {err}"
        );
    }
}

/// `program ARGS` (a link to memvisor), without the log variables.
fn program(path: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(path);
    c.args(args)
        .env_remove("RUST_LOG")
        .env_remove("MEMVISOR_LOG");
    c
}
