//! Framing of what a control client sends: QMP is a stream of JSON values, not of lines.
//!
//! **Model.** QEMU's parser takes a command whenever its outermost braces close, and clients
//! rely on it (python's `qemu.qmp` sends each command with no newline after it). [`Framer`]
//! reads the byte stream one byte at a time and gives out a [`Frame`] whenever one ends: an
//! object (or array) where its braces close, strings and escapes taken into account; anything
//! else at the top level at the end of its line (it is answered with an error). A command
//! longer than [`MAX_LINE`] is not kept, only counted through to its end. The nesting depth
//! saturates, so no input can overflow it.
//!
//! **Strings** are QMP's: `"…"` and, as QEMU's parser takes them, `'…'` ([`requote`] turns
//! the second kind into JSON before the command is parsed).
//!
//! **A lexical error resets it** (qmp-spec.rst, "Forcing the JSON parser into known-good
//! state"): an ASCII control character other than tab, CR and LF, or a byte that is never in
//! UTF-8 (0xC0, 0xC1, 0xF5 to 0xFF), ends whatever was being read as a frame of its own (it is
//! answered with an error) and leaves the framer at the top level, so a client that lost track
//! of its braces sends 0xFF and starts again.

use super::MAX_LINE;

/// One command as it came off the socket.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Frame {
    /// A JSON object or array, whole (or, for anything else, the text up to the line's end).
    Message(Vec<u8>),
    /// One longer than [`MAX_LINE`] bytes, skipped.
    TooLong,
}

/// Splits the byte stream a client sends into commands. QMP is a stream of JSON values, not of
/// lines: QEMU's parser takes an object whenever its braces close, and clients rely on it
/// (python's `qemu.qmp` sends each command with no newline after it). So a command ends where
/// its outermost `{…}` (or `[…]`) closes, strings and escapes taken into account; anything else
/// at the top level (not JSON as QMP wants it) ends at the line's end, to be answered with an
/// error. Whitespace between commands is skipped. A command longer than [`MAX_LINE`] is not
/// kept: its bytes are counted through to its end and it comes out as [`Frame::TooLong`].
#[derive(Default)]
pub(super) struct Framer {
    buf: Vec<u8>,
    depth: u32,
    /// The quote that opened the string being read (`"` or `'`), if one is.
    in_string: Option<u8>,
    escape: bool,
    /// Inside something that is not an object or array: it ends at a newline.
    bare: bool,
    too_long: bool,
}

impl Framer {
    fn keep(&mut self, b: u8) {
        if self.buf.len() < MAX_LINE {
            self.buf.push(b);
        } else {
            self.too_long = true;
        }
    }

    fn take(&mut self) -> Frame {
        let buf = std::mem::take(&mut self.buf);
        let too_long = std::mem::take(&mut self.too_long);
        if too_long {
            Frame::TooLong
        } else {
            Frame::Message(buf)
        }
    }

    /// Takes one byte; a frame when it ends one.
    pub(super) fn push(&mut self, b: u8) -> Option<Frame> {
        if lexical_error(b) {
            self.keep(b);
            self.depth = 0;
            self.in_string = None;
            self.escape = false;
            self.bare = false;
            return Some(self.take());
        }
        if self.bare {
            if b == b'\n' {
                self.bare = false;
                return Some(self.take());
            }
            self.keep(b);
            return None;
        }
        if self.depth == 0 {
            match b {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b'{' | b'[' => {
                    self.depth = 1;
                    self.keep(b);
                }
                _ => {
                    self.bare = true;
                    self.keep(b);
                }
            }
            return None;
        }
        self.keep(b);
        if let Some(quote) = self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == quote {
                self.in_string = None;
            }
            return None;
        }
        match b {
            b'"' | b'\'' => self.in_string = Some(b),
            b'{' | b'[' => self.depth = self.depth.saturating_add(1),
            b'}' | b']' => {
                self.depth -= 1;
                if self.depth == 0 {
                    return Some(self.take());
                }
            }
            _ => {}
        }
        None
    }
}

/// A byte no JSON text holds outside a string's escapes, which QEMU's lexer takes as an
/// error: an ASCII control character other than tab, LF and CR, or a byte never in UTF-8.
fn lexical_error(b: u8) -> bool {
    matches!(b, 0x00..=0x08 | 0x0b | 0x0c | 0x0e..=0x1f | 0xc0 | 0xc1 | 0xf5..=0xff)
}

/// `text` with its single-quoted strings (QEMU's extension of JSON, which QMP accepts) written
/// as JSON strings: `'a"b\'c'` becomes `"a\"b'c"`. Double-quoted strings and everything
/// outside strings are left as they are.
pub(super) fn requote(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains('\'') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    let mut quote = None;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '"' | '\'') => {
                quote = Some(c);
                out.push('"');
            }
            (None, c) => out.push(c),
            (Some(_), '\\') => match chars.next() {
                // An escaped single quote (QEMU takes it in either kind) needs no escape in a
                // JSON string.
                Some('\'') => out.push('\''),
                Some(e) => {
                    out.push('\\');
                    out.push(e);
                }
                None => out.push('\\'),
            },
            (Some(q), c) if c == q => {
                quote = None;
                out.push('"');
            }
            (Some('\''), '"') => out.push_str("\\\""),
            (Some(_), c) => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}
