//! The client side of the control socket (`memvisor ctl`, the tests, the bench).
//!
//! **Model.** [`Client::connect`] reads the QMP greeting and negotiates (`qmp_capabilities`);
//! [`Client::execute`] then sends one command at a time, with an `id` of its own, and reads
//! lines until the answer with that `id` comes: events that come before it are kept, in order,
//! for [`Client::next_event`]. [`request`] is one command on a connection of its own.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// A connected control client: the greeting read, capabilities negotiated, commands sent one
/// at a time, events kept while waiting for an answer.
pub struct Client {
    reader: BufReader<UnixStream>,
    pub(super) writer: UnixStream,
    /// The greeting's `QMP` object.
    pub greeting: Value,
    /// Events that came while an answer was awaited, oldest first.
    pub events: Vec<Value>,
    next_id: u64,
}

impl Client {
    /// Connects to the control socket at `path`, reads the greeting and negotiates
    /// (`qmp_capabilities`): the client is in command mode and receives events.
    pub fn connect(path: &Path) -> Result<Client> {
        let sock = UnixStream::connect(path).with_context(|| {
            format!(
                "cannot connect to the control socket {}: is a memvisor server with \
                 `--control {}` running?",
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
        match first.get("QMP") {
            Some(g) => c.greeting = g.clone(),
            None => match first.get("error") {
                Some(e) => bail!("the server said: {}", e["desc"].as_str().unwrap_or("?")),
                None => bail!(
                    "{} did not greet as a QMP socket (it sent {first})",
                    path.display()
                ),
            },
        }
        c.execute("qmp_capabilities", json!({}))
            .context("capabilities negotiation")?;
        Ok(c)
    }

    pub(super) fn line(&mut self, timeout: Option<Duration>) -> Result<Value> {
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
        // One write for the whole line: the server acts on a command as soon as its JSON object
        // is complete (QMP needs no newline), so after `quit` it may close before a newline
        // written on its own arrives, and that second write would fail with EPIPE.
        self.writer.write_all(format!("{request}\n").as_bytes())?;
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
