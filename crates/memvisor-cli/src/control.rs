//! The control socket: JSON, one object per line, shaped like QEMU's QMP.
//!
//! **Model.** A client connects to the Unix socket `--control PATH` and first reads a greeting,
//! `{"memvisor": {"version": "…", "commands": [...]}}`. It then sends commands, one per line,
//! `{"execute": "query-stats", "arguments": {...}, "id": ANY}` (`arguments` and `id` optional),
//! and gets one answer line for each, in order: `{"return": VALUE, "id": ANY}` or
//! `{"error": {"class": "…", "desc": "…"}, "id": ANY}`. Events go to every connected client as
//! they happen, between answers: `{"event": "FRONTEND_CONNECTED", "data": {...}, "timestamp":
//! {"seconds": S, "microseconds": U}}`. Unlike QMP there is no capability negotiation: events
//! flow from the greeting on.
//!
//! Each connection has a reader thread, which runs commands, and a writer thread, the only one
//! writing to the socket: answers and events reach it through one channel, so lines never
//! interleave and a slow client stalls nobody but itself (a device thread only queues an event).
//! A line longer than [`MAX_LINE`], or one that is not a JSON object, is answered with an error
//! and the connection goes on; at most [`MAX_CLIENTS`] clients are served at once.
//!
//! The commands themselves are the server's ([`Handler`]); [`request`] and [`Client`] are the
//! client side (`memvisor ctl`).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// The longest command line taken, in bytes.
pub const MAX_LINE: usize = 64 * 1024;
/// Clients served at once; one more is told so and closed.
pub const MAX_CLIENTS: usize = 16;

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
    /// The commands it knows, for the greeting and for errors.
    fn commands(&self) -> Vec<&'static str>;
    /// Runs `command` with `arguments` (an object, empty if none came).
    fn execute(&self, command: &str, arguments: &Value) -> Result<Value, CommandError>;
}

/// A connected client's number and the channel to its writer thread.
type Subscriber = (u64, Sender<String>);

/// Where events go: every connected client. Cloning shares it; emitting never blocks.
#[derive(Clone, Default)]
pub struct Events(Arc<Mutex<Vec<Subscriber>>>);

impl Events {
    /// Sends `{"event": name, "data": data, "timestamp": ...}` to every client connected now.
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
        subs.retain(|(_, tx)| tx.send(line.clone()).is_ok());
    }

    /// Sends the greeting and subscribes, under the lock `emit` takes: every event emitted
    /// after the client could read its greeting reaches it, and none comes before the greeting.
    fn subscribe(&self, id: u64, tx: Sender<String>, greeting: String) -> bool {
        let mut subs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if tx.send(greeting).is_err() {
            return false;
        }
        subs.push((id, tx));
        true
    }

    fn unsubscribe(&self, id: u64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(i, _)| *i != id);
    }

    fn clients(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Serves control clients on `listener` until `stop` is set; returns after every connection
/// is closed.
pub fn serve(
    listener: &std::os::unix::net::UnixListener,
    handler: Arc<dyn Handler>,
    events: Events,
    stop: &AtomicBool,
) -> Result<()> {
    listener.set_nonblocking(true)?;
    let open: Arc<Mutex<Vec<UnixStream>>> = Arc::default();
    let mut threads = Vec::new();
    let mut next_id = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let sock = match listener.accept() {
            Ok((sock, _)) => sock,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::Interrupted =>
            {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Err(e) => return Err(e).context("accept on the control socket"),
        };
        let _ = sock.set_nonblocking(false);
        if events.clients() >= MAX_CLIENTS {
            let mut s = sock;
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = writeln!(
                s,
                "{}",
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
        if let Ok(s) = sock.try_clone() {
            open.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
        let (handler, events, id) = (handler.clone(), events.clone(), next_id);
        threads.push(std::thread::spawn(move || {
            connection(sock, id, &*handler, &events)
        }));
        threads.retain(|t| !t.is_finished());
    }
    // Wake every reader: their connections end.
    for s in open.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn connection(sock: UnixStream, id: u64, handler: &dyn Handler, events: &Events) {
    let (tx, rx) = channel::<String>();
    let Ok(out) = sock.try_clone() else {
        return;
    };
    let writer = std::thread::spawn(move || write_lines(out, rx));
    let greeting = json!({"memvisor": {
        "version": env!("CARGO_PKG_VERSION"),
        "commands": handler.commands(),
    }});
    if !events.subscribe(id, tx.clone(), greeting.to_string()) {
        return;
    }
    let mut reader = BufReader::new(sock);
    loop {
        let mut line = Vec::new();
        // One byte past the limit tells a line that is too long.
        match (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let answer = if line.len() > MAX_LINE && !line.ends_with(b"\n") {
            // Skip the rest of the line, then say why.
            let mut rest = Vec::new();
            if reader.read_until(b'\n', &mut rest).is_err() {
                break;
            }
            error_line(
                &CommandError::generic(format!(
                    "a command line of more than {MAX_LINE} bytes; send one JSON object per line"
                )),
                None,
            )
        } else {
            answer(handler, &line)
        };
        if answer.is_empty() {
            continue;
        }
        if tx.send(answer).is_err() {
            break;
        }
    }
    events.unsubscribe(id);
    drop(tx);
    let _ = writer.join();
}

fn write_lines(mut out: UnixStream, rx: Receiver<String>) {
    for line in rx {
        if writeln!(out, "{line}").is_err() {
            // The client is gone; the reader sees it too.
            let _ = out.shutdown(std::net::Shutdown::Both);
            return;
        }
    }
}

/// The answer to one command line (empty for a blank line).
pub fn answer(handler: &dyn Handler, line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    let text = text.trim();
    if text.is_empty() {
        return String::new();
    }
    let request: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return error_line(
                &CommandError::generic(format!(
                    "{} is not JSON ({e}); send {{\"execute\": COMMAND}}",
                    shorten(text)
                )),
                None,
            );
        }
    };
    let id = request.get("id").cloned();
    let Some(command) = request.get("execute").and_then(Value::as_str) else {
        return error_line(
            &CommandError::generic(format!(
                "{} has no \"execute\" string; send {{\"execute\": COMMAND, \"arguments\": {{...}}}}",
                shorten(text)
            )),
            id.as_ref(),
        );
    };
    let empty = json!({});
    let arguments = match request.get("arguments") {
        None => &empty,
        Some(a) if a.is_object() => a,
        Some(a) => {
            return error_line(
                &CommandError::generic(format!("\"arguments\" is {a}; it must be an object")),
                id.as_ref(),
            );
        }
    };
    match handler.execute(command, arguments) {
        Ok(value) => {
            let mut v = json!({"return": value});
            if let Some(id) = id {
                v["id"] = id;
            }
            v.to_string()
        }
        Err(e) => error_line(&e, id.as_ref()),
    }
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

/// The error for a command the handler does not know.
pub fn unknown_command(command: &str, known: &[&str]) -> CommandError {
    CommandError {
        class: "CommandNotFound",
        desc: format!(
            "the command {command:?} was not found; known: {}",
            known.join(", ")
        ),
    }
}

/// A connected control client: the greeting read, commands sent one at a time, events kept
/// while waiting for an answer.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// The greeting's `memvisor` object.
    pub greeting: Value,
    /// Events that came while an answer was awaited, oldest first.
    pub events: Vec<Value>,
    next_id: u64,
}

impl Client {
    /// Connects to the control socket at `path` and reads the greeting.
    pub fn connect(path: &Path) -> Result<Client> {
        let sock = UnixStream::connect(path).with_context(|| {
            format!(
                "cannot connect to the control socket {}: is `memvisor serve --control {}` \
                 running?",
                path.display(),
                path.display()
            )
        })?;
        let writer = sock.try_clone()?;
        let mut c = Client {
            reader: BufReader::new(sock),
            writer,
            greeting: Value::Null,
            events: Vec::new(),
            next_id: 0,
        };
        let first = c.line(Some(Duration::from_secs(10)))?;
        match first.get("memvisor") {
            Some(g) => c.greeting = g.clone(),
            None => match first.get("error") {
                Some(e) => bail!("the server said: {}", e["desc"].as_str().unwrap_or("?")),
                None => bail!(
                    "{} did not greet as a memvisor control socket",
                    path.display()
                ),
            },
        }
        Ok(c)
    }

    fn line(&mut self, timeout: Option<Duration>) -> Result<Value> {
        self.reader.get_ref().set_read_timeout(timeout)?;
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).map_err(|e| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                anyhow::anyhow!("no answer from the control socket within {timeout:?}")
            } else {
                anyhow::Error::new(e).context("reading the control socket")
            }
        })?;
        if n == 0 {
            bail!("the control socket closed");
        }
        serde_json::from_str(&line).with_context(|| format!("the server sent {line:?}"))
    }

    /// Runs `command` with `arguments`; the `return` value, or the server's error as
    /// `CLASS: desc`.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value> {
        self.next_id += 1;
        let id = self.next_id;
        let request = json!({"execute": command, "arguments": arguments, "id": id});
        writeln!(self.writer, "{request}")?;
        loop {
            let v = self.line(Some(Duration::from_secs(30)))?;
            if v.get("event").is_some() {
                self.events.push(v);
                continue;
            }
            if v.get("id").and_then(Value::as_u64) != Some(id) {
                bail!("an answer for another request: {v}");
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            let e = &v["error"];
            bail!(
                "{}: {}",
                e["class"].as_str().unwrap_or("Error"),
                e["desc"].as_str().unwrap_or("?")
            );
        }
    }

    /// The next event (one kept from before, or the next to come), within `timeout`.
    pub fn next_event(&mut self, timeout: Duration) -> Result<Value> {
        if !self.events.is_empty() {
            return Ok(self.events.remove(0));
        }
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                bail!("no event within {timeout:?}");
            }
            let v = self.line(Some(left))?;
            if v.get("event").is_some() {
                return Ok(v);
            }
        }
    }
}

/// Connects, runs one command and returns its value (`memvisor ctl`).
pub fn request(path: &Path, command: &str, arguments: Value) -> Result<Value> {
    Client::connect(path)?.execute(command, arguments)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn parse(s: String) -> Value {
        serde_json::from_str(&s).unwrap()
    }

    #[test]
    fn a_command_gets_its_return_with_the_id_it_came_with() {
        let a = parse(answer(
            &Echo,
            br#"{"execute": "echo", "arguments": {"x": 1}, "id": "a"}"#,
        ));
        assert_eq!(a, json!({"return": {"x": 1}, "id": "a"}));
        let a = parse(answer(&Echo, br#"{"execute": "echo"}"#));
        assert_eq!(a, json!({"return": {}}));
        assert_eq!(answer(&Echo, b"   \n"), "");
    }

    #[test]
    fn bad_lines_get_an_error_that_names_them() {
        for (line, class, says) in [
            (&b"target 5"[..], "GenericError", "\"target 5\" is not JSON"),
            (
                br#"{"exec": "echo"}"#,
                "GenericError",
                "no \"execute\" string",
            ),
            (
                br#"{"execute": "echo", "arguments": [1]}"#,
                "GenericError",
                "\"arguments\" is [1]",
            ),
            (
                br#"{"execute": "nope"}"#,
                "CommandNotFound",
                "\"nope\" was not found; known: echo",
            ),
        ] {
            let a = parse(answer(&Echo, line));
            assert_eq!(a["error"]["class"], class, "{a}");
            assert!(a["error"]["desc"].as_str().unwrap().contains(says), "{a}");
        }
    }

    #[test]
    fn clients_get_answers_and_events_and_a_long_line_does_not_end_the_connection() {
        let dir = std::env::temp_dir().join(format!("memvisor-control-{}", std::process::id()));
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
        let mut a = Client::connect(&path).unwrap();
        let mut b = Client::connect(&path).unwrap();
        assert_eq!(a.greeting["commands"], json!(["echo"]));
        // Both are subscribed once their greeting came; an event reaches both.
        events.emit("FRONTEND_CONNECTED", json!({"device": "blk0"}));
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
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
