//! The control socket: QEMU's QMP (docs/interop/qmp-spec.rst), JSON objects over a Unix socket.
//!
//! **Model.** A client connects to the Unix socket `--control PATH` and first reads the
//! greeting, `{"QMP": {"version": {"qemu": {"major", "minor", "micro"}, "package": "memvisor
//! X.Y.Z"}, "capabilities": []}}` (the numbers are memvisor's own version; no capability is
//! offered, so neither `oob` nor any other may be enabled). The connection starts in QMP's
//! *capabilities negotiation* mode: only `qmp_capabilities` runs; every other command is
//! answered with class `CommandNotFound`, as QEMU answers it, and no event is sent. Once
//! `qmp_capabilities` succeeded the connection is in *command* mode: commands run, events
//! arrive, and a second `qmp_capabilities` is refused (`CommandNotFound`, as in QEMU).
//!
//! A command is `{"execute": "query-stats", "arguments": {...}, "id": ANY}` (`arguments` and
//! `id` optional); each gets one answer line, in order: `{"return": VALUE, "id": ANY}` or
//! `{"error": {"class": "…", "desc": "…"}, "id": ANY}`, the `id` copied back whatever JSON it
//! is, and left out when the command had none (or was not an object at all). Events go to every
//! client in command mode as they happen, between answers: `{"event": "FRONTEND_CONNECTED",
//! "data": {...}, "timestamp": {"seconds": S, "microseconds": U}}`.
//!
//! Three commands belong to the protocol and are run here for every server: `qmp_capabilities`,
//! `query-commands` (QMP's shape, `[{"name": …}, …]`) and `quit`, which answers `{}` and then
//! stops the server exactly as SIGTERM does: it sets the same stop flag the signal handler sets
//! (the `stop` given to [`serve`]). The rest are the server's ([`Handler`]).
//!
//! Each connection has a reader thread, which runs commands, and a writer thread, the only one
//! writing to the socket: answers and events reach it through one channel, so lines never
//! interleave and a slow client stalls nobody but itself (a device thread only queues an event).
//! The channel holds at most [`QUEUE`] lines: a client that sends commands without reading the
//! answers is read no faster than it reads, one whose events pile up that far is disconnected
//! (it would otherwise grow the server's memory without end), and a write that blocks for
//! [`WRITE_TIMEOUT`] ends the connection. A failing `accept` (EMFILE at the fd limit) is logged
//! and retried: a host limit never closes the control socket.
//! Commands are read as QMP streams them, not by lines: one ends where its braces close
//! (`Framer`), newline or not. A command longer than [`MAX_LINE`], or one that is not a JSON
//! object, is answered with an error and the connection goes on; the server's own messages are
//! one per line; at most [`MAX_CLIENTS`] clients are served at once.
//!
//! [`request`] and [`Client`] are the client side (`memvisor ctl`): they read the greeting,
//! negotiate, then run commands.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use serde_json::{Value, json};

mod client;
mod framer;

pub use client::{Client, request};
use framer::{Frame, Framer};

/// The longest command line taken, in bytes.
pub const MAX_LINE: usize = 64 * 1024;
/// Clients served at once; one more is told so and closed.
pub const MAX_CLIENTS: usize = 16;
/// Lines (answers and events) queued for one client's writer at most.
pub const QUEUE: usize = 256;
/// How long one write to a client may block before the client is taken as gone.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The commands every control socket runs itself, whatever its server.
pub const PROTOCOL_COMMANDS: [&str; 3] = ["qmp_capabilities", "query-commands", "quit"];

/// A command's failure: QMP's error class and a message that names the bad value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandError {
    /// `GenericError`, `CommandNotFound` or `DeviceNotFound`.
    pub class: &'static str,
    pub desc: String,
}

impl CommandError {
    /// A bad argument or a command that cannot be carried out.
    pub fn generic(desc: impl Into<String>) -> CommandError {
        CommandError {
            class: "GenericError",
            desc: desc.into(),
        }
    }

    /// A device id that names no device.
    pub fn no_device(desc: impl Into<String>) -> CommandError {
        CommandError {
            class: "DeviceNotFound",
            desc: desc.into(),
        }
    }
}

/// What runs the commands: the server behind the socket.
pub trait Handler: Send + Sync {
    /// The commands it knows (the protocol's own, [`PROTOCOL_COMMANDS`], are added to them).
    fn commands(&self) -> Vec<&'static str>;
    /// Runs `command` with `arguments` (an object, empty if none came).
    fn execute(&self, command: &str, arguments: &Value) -> Result<Value, CommandError>;
    /// The arguments `command` takes, where the handler lists them: any other is refused
    /// before the command runs (qmp-spec.rst: a key the server does not understand is an
    /// error, reported before any side effect). `None`: the command checks its own.
    fn arguments(&self, command: &str) -> Option<&'static [&'static str]> {
        let _ = command;
        None
    }
}

/// `GenericError` for an argument `command` does not take, in QEMU's words.
fn unexpected(handler: &dyn Handler, command: &str, arguments: &Value) -> Result<(), CommandError> {
    let (Some(allowed), Some(given)) = (handler.arguments(command), arguments.as_object()) else {
        return Ok(());
    };
    match given.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(CommandError::generic(format!(
            "Parameter '{k}' is unexpected ({command} takes {})",
            if allowed.is_empty() {
                "no arguments".to_string()
            } else {
                allowed.join(", ")
            }
        ))),
        None => Ok(()),
    }
}

/// A client in command mode: its number, the channel to its writer thread, and its socket (shut
/// down if it lets [`QUEUE`] lines pile up).
type Subscriber = (u64, SyncSender<String>, UnixStream);

/// Where events go: every client in command mode. Cloning shares it; emitting never blocks.
#[derive(Clone, Default)]
pub struct Events(Arc<Mutex<Vec<Subscriber>>>);

impl Events {
    /// Sends `{"event": name, "data": data, "timestamp": ...}` to every client subscribed now.
    pub fn emit(&self, name: &str, data: Value) {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let line = json!({
            "event": name,
            "data": data,
            "timestamp": {"seconds": t.as_secs(), "microseconds": t.subsec_micros()},
        })
        .to_string();
        let mut subs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        subs.retain(|(id, tx, sock)| offer(*id, tx, sock, line.clone()));
    }

    /// Sends `first` (the answer to `qmp_capabilities`) and subscribes, under the lock `emit`
    /// takes: every event emitted after the client could read that answer reaches it, and none
    /// comes before it.
    fn subscribe(&self, id: u64, tx: SyncSender<String>, sock: UnixStream, first: String) -> bool {
        let mut subs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !offer(id, &tx, &sock, first) {
            return false;
        }
        subs.push((id, tx, sock));
        true
    }

    fn unsubscribe(&self, id: u64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(i, _, _)| *i != id);
    }
}

/// Queues `line` for client `id` without waiting; a client with [`QUEUE`] lines unread is shut
/// down (its reader and writer then end). False if the client is gone or was shut down.
fn offer(id: u64, tx: &SyncSender<String>, sock: &UnixStream, line: String) -> bool {
    match tx.try_send(line) {
        Ok(()) => true,
        Err(TrySendError::Full(_)) => {
            log::warn!(
                "control client {id} has {QUEUE} answers and events unread: disconnecting it"
            );
            let _ = sock.shutdown(std::net::Shutdown::Both);
            false
        }
        Err(TrySendError::Disconnected(_)) => false,
    }
}

/// The greeting: memvisor's version in QMP's `VersionInfo` shape, no capabilities.
pub fn greeting() -> Value {
    let number = |s: &str| s.parse::<u64>().unwrap_or(0);
    json!({"QMP": {
        "version": {
            "qemu": {
                "major": number(env!("CARGO_PKG_VERSION_MAJOR")),
                "minor": number(env!("CARGO_PKG_VERSION_MINOR")),
                "micro": number(env!("CARGO_PKG_VERSION_PATCH")),
            },
            "package": concat!("memvisor ", env!("CARGO_PKG_VERSION")),
        },
        "capabilities": [],
    }})
}

/// Serves control clients on `listener` until `stop` is set (by a signal, or by a client's
/// `quit`); returns after every connection is closed.
pub fn serve(
    listener: &std::os::unix::net::UnixListener,
    handler: Arc<dyn Handler>,
    events: Events,
    stop: &AtomicBool,
) -> Result<()> {
    listener.set_nonblocking(true)?;
    let open: Mutex<Vec<(u64, UnixStream)>> = Mutex::default();
    std::thread::scope(|scope| -> Result<()> {
        let mut threads = Vec::new();
        let mut next_id = 0u64;
        let result = loop {
            if stop.load(Ordering::Relaxed) {
                break Ok(());
            }
            let sock = match listener.accept() {
                Ok((sock, _)) => sock,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::Interrupted =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS...: the host's limit, not the socket's end.
                    log::warn!("control socket: accept: {e}; trying again in 1 s");
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            };
            let _ = sock.set_nonblocking(false);
            threads.retain(|t: &std::thread::ScopedJoinHandle<()>| !t.is_finished());
            if threads.len() >= MAX_CLIENTS {
                let mut s = sock;
                let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = write!(
                    s,
                    "{}\r\n",
                    error_line(
                        &CommandError::generic(format!(
                            "{MAX_CLIENTS} control clients are connected already; try again later"
                        )),
                        None
                    )
                );
                continue;
            }
            next_id += 1;
            let id = next_id;
            if let Ok(s) = sock.try_clone() {
                open.lock().unwrap_or_else(|e| e.into_inner()).push((id, s));
            }
            let (handler, events, open) = (&*handler, &events, &open);
            threads.push(scope.spawn(move || {
                connection(sock, id, handler, events, stop);
                open.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|(i, _)| *i != id);
            }));
        };
        // Wake every reader: their connections end.
        for (_, s) in open.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        result
    })
}

/// What the connection does once an answer is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Nothing: read the next command.
    Next,
    /// `qmp_capabilities` succeeded: command mode; subscribe to events with the answer.
    Negotiated,
    /// `quit`: write the answer, close, and stop the server.
    Quit,
}

fn connection(
    sock: UnixStream,
    id: u64,
    handler: &dyn Handler,
    events: &Events,
    stop: &AtomicBool,
) {
    let (tx, rx) = sync_channel::<String>(QUEUE);
    let Ok(out) = sock.try_clone() else {
        return;
    };
    let _ = out.set_write_timeout(Some(WRITE_TIMEOUT));
    let writer = std::thread::spawn(move || write_lines(out, rx));
    let mut negotiated = false;
    let mut quit = false;
    if tx.send(greeting().to_string()).is_ok() {
        let mut reader = sock;
        let mut framer = Framer::default();
        let mut chunk = [0u8; 4096];
        let mut frames = std::collections::VecDeque::new();
        'read: loop {
            let n = match reader.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            frames.extend(chunk[..n].iter().filter_map(|&b| framer.push(b)));
            while let Some(frame) = frames.pop_front() {
                let (answer, then) = match frame {
                    Frame::TooLong => {
                        let e = CommandError::generic(format!(
                            "a command of more than {MAX_LINE} bytes; send one JSON object at a time"
                        ));
                        (error_line(&e, None), Then::Next)
                    }
                    Frame::Message(m) => respond(handler, &m, negotiated),
                };
                let sent = match then {
                    _ if answer.is_empty() => true,
                    Then::Negotiated => {
                        negotiated = true;
                        match reader.try_clone() {
                            Ok(sock) => events.subscribe(id, tx.clone(), sock, answer),
                            Err(_) => false,
                        }
                    }
                    Then::Next | Then::Quit => tx.send(answer).is_ok(),
                };
                if !sent {
                    break 'read;
                }
                if then == Then::Quit {
                    quit = true;
                    break 'read;
                }
            }
        }
    }
    events.unsubscribe(id);
    drop(tx);
    // The answer to `quit` is written before the server stops.
    let _ = writer.join();
    if quit {
        log::info!("control socket: quit; stopping as for SIGTERM");
        stop.store(true, Ordering::Relaxed);
    }
}

fn write_lines(mut out: UnixStream, rx: Receiver<String>) {
    for line in rx {
        // qmp-spec.rst: what the server sends always ends with CRLF.
        if write!(out, "{line}\r\n").is_err() {
            // The client is gone; the reader sees it too.
            let _ = out.shutdown(std::net::Shutdown::Both);
            return;
        }
    }
}

/// The answer to one command line of a connection in command mode (`negotiated`) or not, and
/// what the connection does next. The answer is empty for a blank line.
pub fn respond(handler: &dyn Handler, line: &[u8], negotiated: bool) -> (String, Then) {
    let text = String::from_utf8_lossy(line);
    let text = text.trim();
    if text.is_empty() {
        return (String::new(), Then::Next);
    }
    let fail = |e: CommandError, id: Option<&Value>| (error_line(&e, id), Then::Next);
    let request: Value = match serde_json::from_str(&framer::requote(text)) {
        Ok(v) => v,
        Err(e) => {
            return fail(
                CommandError::generic(format!(
                    "{} is not JSON ({e}); send {{\"execute\": COMMAND}}",
                    shorten(text)
                )),
                None,
            );
        }
    };
    if !request.is_object() {
        return fail(
            CommandError::generic(format!(
                "QMP input must be a JSON object, not {}; send {{\"execute\": COMMAND}}",
                shorten(text)
            )),
            None,
        );
    }
    let id = request.get("id");
    let Some(command) = request.get("execute").and_then(Value::as_str) else {
        return fail(
            CommandError::generic(format!(
                "{} has no \"execute\" string; send {{\"execute\": COMMAND, \"arguments\": {{...}}}}",
                shorten(text)
            )),
            id,
        );
    };
    let empty = json!({});
    let arguments = match request.get("arguments") {
        None => &empty,
        Some(a) if a.is_object() => a,
        Some(a) => {
            return fail(
                CommandError::generic(format!("\"arguments\" is {a}; it must be an object")),
                id,
            );
        }
    };
    let (result, then) = match (command, negotiated) {
        ("qmp_capabilities", false) => match capabilities(arguments) {
            Ok(()) => (Ok(json!({})), Then::Negotiated),
            Err(e) => (Err(e), Then::Next),
        },
        // QEMU's classes and wording (monitor/qmp.c, monitor/qmp-cmds-control.c).
        ("qmp_capabilities", true) => (
            Err(CommandError {
                class: "CommandNotFound",
                desc: "Capabilities negotiation is already complete, command ignored".into(),
            }),
            Then::Next,
        ),
        (_, false) => (
            Err(CommandError {
                class: "CommandNotFound",
                desc: "Expecting capabilities negotiation with 'qmp_capabilities'".into(),
            }),
            Then::Next,
        ),
        ("query-commands", true) => (
            Ok(json!(
                commands(handler)
                    .into_iter()
                    .map(|name| json!({"name": name}))
                    .collect::<Vec<_>>()
            )),
            Then::Next,
        ),
        ("quit", true) => (Ok(json!({})), Then::Quit),
        (command, true) => (
            unexpected(handler, command, arguments)
                .and_then(|()| handler.execute(command, arguments)),
            Then::Next,
        ),
    };
    match result {
        Ok(value) => {
            let mut v = json!({"return": value});
            if let Some(id) = id {
                v["id"] = id.clone();
            }
            (v.to_string(), then)
        }
        Err(e) => fail(e, id),
    }
}

/// Checks `qmp_capabilities`'s arguments: `enable` may list only capabilities the greeting
/// offered, and it offers none.
fn capabilities(arguments: &Value) -> Result<(), CommandError> {
    if let Some(other) = arguments
        .as_object()
        .and_then(|a| a.keys().find(|k| *k != "enable"))
    {
        return Err(CommandError::generic(format!(
            "qmp_capabilities has no argument {other:?}; it takes only \"enable\""
        )));
    }
    match arguments.get("enable") {
        None => Ok(()),
        Some(Value::Array(caps)) => match caps.first() {
            None => Ok(()),
            Some(cap) => Err(CommandError::generic(format!(
                "Capability {cap} not available: the greeting offers none"
            ))),
        },
        Some(other) => Err(CommandError::generic(format!(
            "\"enable\" is {other}; it must be a list of capabilities"
        ))),
    }
}

/// Every command a connection in command mode runs: the protocol's and the handler's.
pub fn commands(handler: &dyn Handler) -> Vec<&'static str> {
    let mut all: Vec<&'static str> = PROTOCOL_COMMANDS.to_vec();
    for c in handler.commands() {
        if !all.contains(&c) {
            all.push(c);
        }
    }
    all
}

fn error_line(e: &CommandError, id: Option<&Value>) -> String {
    let mut v = json!({"error": {"class": e.class, "desc": e.desc}});
    if let Some(id) = id {
        v["id"] = id.clone();
    }
    v.to_string()
}

fn shorten(text: &str) -> String {
    let mut s: String = text.chars().take(80).collect();
    if s.len() < text.len() {
        s.push('…');
    }
    format!("{s:?}")
}

/// The error for a command the handler does not know: QEMU's class and wording, then the
/// commands there are.
pub fn unknown_command(command: &str, known: &[&str]) -> CommandError {
    CommandError {
        class: "CommandNotFound",
        desc: format!(
            "The command {command} has not been found (known: {})",
            known.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};

    struct Echo;

    impl Handler for Echo {
        fn commands(&self) -> Vec<&'static str> {
            vec!["echo"]
        }

        fn execute(&self, command: &str, arguments: &Value) -> Result<Value, CommandError> {
            match command {
                "echo" => Ok(arguments.clone()),
                other => Err(unknown_command(other, &self.commands())),
            }
        }
    }

    fn parse(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    /// The answer of a connection in command mode.
    fn answer(line: &[u8]) -> Value {
        let (a, then) = respond(&Echo, line, true);
        assert_eq!(then, Then::Next);
        parse(&a)
    }

    #[test]
    fn a_command_gets_its_return_with_the_id_it_came_with() {
        let a = answer(br#"{"execute": "echo", "arguments": {"x": 1}, "id": "a"}"#);
        assert_eq!(a, json!({"return": {"x": 1}, "id": "a"}));
        // Any JSON value is an id, copied back as it came.
        let a = answer(br#"{"execute": "echo", "id": {"n": [1, 2]}}"#);
        assert_eq!(a, json!({"return": {}, "id": {"n": [1, 2]}}));
        assert_eq!(answer(br#"{"execute": "echo"}"#), json!({"return": {}}));
        assert_eq!(respond(&Echo, b"   \n", true), (String::new(), Then::Next));
    }

    #[test]
    fn bad_lines_get_an_error_that_names_them() {
        for (line, class, says) in [
            (&b"target 5"[..], "GenericError", "\"target 5\" is not JSON"),
            (b"[1]", "GenericError", "QMP input must be a JSON object"),
            (
                br#"{"exec": "echo", "id": 3}"#,
                "GenericError",
                "no \"execute\" string",
            ),
            (
                br#"{"execute": "echo", "arguments": [1], "id": 3}"#,
                "GenericError",
                "\"arguments\" is [1]",
            ),
            (
                br#"{"execute": "nope", "id": 3}"#,
                "CommandNotFound",
                "The command nope has not been found (known: echo)",
            ),
        ] {
            let a = answer(line);
            assert_eq!(a["error"]["class"], class, "{a}");
            assert!(a["error"]["desc"].as_str().unwrap().contains(says), "{a}");
            // The id comes back wherever the request was an object that had one.
            let want_id = if line.starts_with(b"{") {
                json!(3)
            } else {
                Value::Null
            };
            assert_eq!(a.get("id").cloned().unwrap_or(Value::Null), want_id, "{a}");
        }
    }

    fn frames(bytes: &[u8]) -> Vec<Frame> {
        let mut f = Framer::default();
        bytes.iter().filter_map(|&b| f.push(b)).collect()
    }

    fn message(s: &str) -> Frame {
        Frame::Message(s.as_bytes().to_vec())
    }

    #[test]
    fn commands_end_where_their_braces_close_newline_or_not() {
        // As python's qemu.qmp sends them: back to back, no newline.
        let a = r#"{"execute":"qmp_capabilities","id":"__qmp#00000"}"#;
        let b = r#"{"execute":"echo","arguments":{"s":"}{\"]"}}"#;
        assert_eq!(
            frames(format!("{a}{b}").as_bytes()),
            [message(a), message(b)]
        );
        // Spread over lines, and a line of something else.
        assert_eq!(
            frames(b"\n {\n \"execute\":\n \"echo\"\n}\r\ntarget 5\n[1]"),
            [
                message("{\n \"execute\":\n \"echo\"\n}"),
                message("target 5"),
                message("[1]")
            ]
        );
        // Too long: skipped through its end, then the next one is whole.
        let long = format!(r#"{{"pad": "{}"}}{a}"#, "}".repeat(MAX_LINE));
        assert_eq!(frames(long.as_bytes()), [Frame::TooLong, message(a)]);
        // Single-quoted strings are strings: a brace inside one ends nothing.
        let q = r#"{'execute': 'echo', 'arguments': {'s': '}"'}}"#;
        assert_eq!(frames(q.as_bytes()), [message(q)]);
    }

    /// qmp-spec.rst, "Forcing the JSON parser into known-good state": a control character
    /// (other than tab, CR, LF) or 0xFF ends what was being read, and the next command is read
    /// whole.
    #[test]
    fn a_lexical_error_brings_the_framer_back_to_the_top_level() {
        let a = r#"{"execute":"qmp_capabilities","id":"after"}"#;
        for bad in [0x1bu8, 0xff, 0x00, 0xc0] {
            let mut input = br#"{"execute": "echo", "arguments": {"s": "x"#.to_vec();
            input.push(bad);
            input.extend_from_slice(a.as_bytes());
            let got = frames(&input);
            assert_eq!(got.len(), 2, "{bad:#x}: {got:?}");
            assert_eq!(got[1], message(a), "{bad:#x}");
            // What was cut off is answered with an error, not taken as a command.
            let Frame::Message(cut) = &got[0] else {
                panic!("{bad:#x}: {got:?}")
            };
            assert_eq!(answer(cut)["error"]["class"], "GenericError", "{bad:#x}");
        }
    }

    #[test]
    fn single_quoted_strings_are_read_as_json_strings() {
        for (text, want) in [
            (r#"{'a': 'b'}"#, json!({"a": "b"})),
            (r#"{'a': 'say "hi"'}"#, json!({"a": "say \"hi\""})),
            (r#"{'a': 'it\'s'}"#, json!({"a": "it's"})),
            (
                r#"{"a": "it's", 'b': "x\"y"}"#,
                json!({"a": "it's", "b": "x\"y"}),
            ),
        ] {
            let v: Value = serde_json::from_str(&framer::requote(text))
                .unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(v, want, "{text}");
        }
        let a = answer(br#"{'execute': 'echo', 'id': 'sq'}"#);
        assert_eq!(a["id"], "sq", "{a}");
        assert!(a.get("error").is_none(), "{a}");
    }

    #[test]
    fn the_greeting_has_the_shape_qmp_clients_check() {
        let g = greeting();
        let version = &g["QMP"]["version"];
        for part in ["major", "minor", "micro"] {
            assert!(version["qemu"][part].is_u64(), "{g}");
        }
        assert_eq!(
            version["package"],
            format!("memvisor {}", env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(g["QMP"]["capabilities"], json!([]));
    }

    #[test]
    fn before_negotiation_only_qmp_capabilities_runs_and_after_it_is_refused() {
        // Not negotiated: every other command, the protocol's too, is refused as QEMU does.
        for command in ["echo", "query-commands", "quit", "nope"] {
            let line = format!(r#"{{"execute": "{command}", "id": 7}}"#);
            let (a, then) = respond(&Echo, line.as_bytes(), false);
            assert_eq!(then, Then::Next, "{command}");
            assert_eq!(
                parse(&a),
                json!({"error": {"class": "CommandNotFound", "desc":
                    "Expecting capabilities negotiation with 'qmp_capabilities'"}, "id": 7})
            );
        }
        // A capability the greeting did not offer is refused; the connection stays as it was.
        for args in [
            r#"{"enable": ["oob"]}"#,
            r#"{"enable": "oob"}"#,
            r#"{"other": 1}"#,
        ] {
            let line = format!(r#"{{"execute": "qmp_capabilities", "arguments": {args}}}"#);
            let (a, then) = respond(&Echo, line.as_bytes(), false);
            assert_eq!(then, Then::Next, "{args}");
            assert_eq!(parse(&a)["error"]["class"], "GenericError", "{a}");
        }
        for line in [
            &br#"{"execute": "qmp_capabilities", "id": "n"}"#[..],
            br#"{"execute": "qmp_capabilities", "arguments": {"enable": []}, "id": "n"}"#,
        ] {
            let (a, then) = respond(&Echo, line, false);
            assert_eq!(then, Then::Negotiated);
            assert_eq!(parse(&a), json!({"return": {}, "id": "n"}));
        }
        // In command mode a second negotiation is refused.
        let a = answer(br#"{"execute": "qmp_capabilities", "id": 8}"#);
        assert_eq!(
            a,
            json!({"error": {"class": "CommandNotFound", "desc":
                "Capabilities negotiation is already complete, command ignored"}, "id": 8})
        );
    }

    #[test]
    fn query_commands_lists_names_and_quit_answers_then_quits() {
        let a = answer(br#"{"execute": "query-commands"}"#);
        assert_eq!(
            a["return"],
            json!([{"name": "qmp_capabilities"}, {"name": "query-commands"},
                   {"name": "quit"}, {"name": "echo"}])
        );
        let (a, then) = respond(&Echo, br#"{"execute": "quit", "id": 1}"#, true);
        assert_eq!(then, Then::Quit);
        assert_eq!(parse(&a), json!({"return": {}, "id": 1}));
    }

    struct Running {
        path: std::path::PathBuf,
        events: Events,
        stop: Arc<AtomicBool>,
        server: std::thread::JoinHandle<Result<()>>,
    }

    fn start(name: &str) -> Running {
        let dir =
            std::env::temp_dir().join(format!("memvisor-control-{}-{name}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("ctl.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let events = Events::default();
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let (events, stop) = (events.clone(), stop.clone());
            std::thread::spawn(move || serve(&listener, Arc::new(Echo), events, &stop))
        };
        Running {
            path,
            events,
            stop,
            server,
        }
    }

    fn read_line(r: &mut BufReader<UnixStream>) -> Value {
        r.get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        parse(&line)
    }

    #[test]
    fn no_event_reaches_a_client_before_it_negotiated() {
        let s = start("events");
        let sock = UnixStream::connect(&s.path).unwrap();
        let mut w = sock.try_clone().unwrap();
        let mut r = BufReader::new(sock);
        assert!(read_line(&mut r).get("QMP").is_some());
        // Refused commands answer in order; the event emitted now is not this client's.
        writeln!(w, r#"{{"execute": "echo", "id": 1}}"#).unwrap();
        assert_eq!(read_line(&mut r)["id"], 1);
        s.events
            .emit("FRONTEND_CONNECTED", json!({"device": "blk0"}));
        writeln!(w, r#"{{"execute": "qmp_capabilities", "id": 2}}"#).unwrap();
        assert_eq!(read_line(&mut r), json!({"return": {}, "id": 2}));
        // From here on events come.
        s.events
            .emit("FRONTEND_DISCONNECTED", json!({"device": "blk0"}));
        assert_eq!(read_line(&mut r)["event"], "FRONTEND_DISCONNECTED");
        s.stop.store(true, Ordering::Relaxed);
        s.server.join().unwrap().unwrap();
    }

    #[test]
    fn a_client_that_never_reads_its_events_is_cut_off_and_the_others_go_on() {
        let s = start("unread");
        // Negotiates, then never reads a byte.
        let mut deaf = UnixStream::connect(&s.path).unwrap();
        writeln!(deaf, r#"{{"execute": "qmp_capabilities"}}"#).unwrap();
        let mut other = Client::connect(&s.path).unwrap();
        // Both subscribed: an event reaches the reading one.
        let t0 = std::time::Instant::now();
        loop {
            s.events.emit("PING", json!({}));
            if other.next_event(Duration::from_millis(200)).is_ok() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no event reached the client"
            );
        }
        // Far more than the deaf client's socket buffer and queue hold (8 MiB); emit never
        // waits. The reading client reads each batch of 32 before the next.
        let pad = "x".repeat(4096);
        let events = 2048;
        for batch in 0..events / 32 {
            for n in 0..32 {
                s.events
                    .emit("BULK", json!({"n": batch * 32 + n, "pad": pad}));
            }
            for _ in 0..32 {
                let e = other.next_event(Duration::from_secs(10)).unwrap();
                assert_eq!(e["event"], "BULK");
            }
        }
        // The deaf client was disconnected: reading it now drains what was written, then EOF.
        deaf.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut sink = [0u8; 65536];
        let mut total = 0usize;
        loop {
            match deaf.read(&mut sink) {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) => panic!("the deaf client was not disconnected ({total} bytes read): {e}"),
            }
        }
        assert!(total < events * 4096, "{total} bytes: it got every event");
        // The other client is still served.
        assert_eq!(
            other.execute("echo", json!({"n": 1})).unwrap(),
            json!({"n": 1})
        );
        s.stop.store(true, Ordering::Relaxed);
        s.server.join().unwrap().unwrap();
    }

    #[test]
    fn quit_answers_then_stops_the_server_through_its_stop_flag() {
        let s = start("quit");
        let mut other = Client::connect(&s.path).unwrap();
        let mut c = Client::connect(&s.path).unwrap();
        assert!(!s.stop.load(Ordering::Relaxed));
        assert_eq!(c.execute("quit", json!({})).unwrap(), json!({}));
        // The flag a signal sets is set: the serving loop ends, every connection with it.
        let t0 = std::time::Instant::now();
        while !s.server.is_finished() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "quit did not stop the server"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s.server.join().unwrap().unwrap();
        assert!(s.stop.load(Ordering::Relaxed));
        let e = other.execute("echo", json!({})).unwrap_err().to_string();
        assert!(e.contains("closed") || e.contains("Broken pipe"), "{e}");
    }

    #[test]
    fn clients_get_answers_and_events_and_a_long_line_does_not_end_the_connection() {
        let s = start("long");
        let mut a = Client::connect(&s.path).unwrap();
        let mut b = Client::connect(&s.path).unwrap();
        assert_eq!(a.greeting["capabilities"], json!([]));
        // Both are subscribed once negotiated; an event reaches both.
        s.events
            .emit("FRONTEND_CONNECTED", json!({"device": "blk0"}));
        for c in [&mut a, &mut b] {
            let e = c.next_event(Duration::from_secs(5)).unwrap();
            assert_eq!(e["event"], "FRONTEND_CONNECTED");
            assert_eq!(e["data"]["device"], "blk0");
            assert!(e["timestamp"]["seconds"].as_u64().unwrap() > 0);
        }
        // A line past the limit is refused; the next command on the connection is answered.
        let long = format!(
            "{{\"execute\": \"echo\", \"pad\": \"{}\"}}\n",
            "x".repeat(MAX_LINE)
        );
        a.writer.write_all(long.as_bytes()).unwrap();
        let refused = a.line(Some(Duration::from_secs(5))).unwrap();
        assert!(
            refused["error"]["desc"]
                .as_str()
                .unwrap()
                .contains("more than 65536 bytes")
        );
        assert_eq!(a.execute("echo", json!({"n": 2})).unwrap(), json!({"n": 2}));
        let e = b.execute("nope", json!({})).unwrap_err().to_string();
        assert!(e.starts_with("CommandNotFound:"), "{e}");
        s.stop.store(true, Ordering::Relaxed);
        s.server.join().unwrap().unwrap();
        let _ = std::fs::remove_dir_all(s.path.parent().unwrap());
    }
}
