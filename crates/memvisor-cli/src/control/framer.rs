//! Framing of what a control client sends: QMP is a stream of JSON values, not of lines.
//!
//! **Model.** QEMU's parser takes a command whenever its outermost braces close, and clients
//! rely on it (python's `qemu.qmp` sends each command with no newline after it). [`Framer`]
//! reads the byte stream one byte at a time and gives out a [`Frame`] whenever one ends: an
//! object (or array) where its braces close, strings and escapes taken into account; anything
//! else at the top level at the end of its line (it is answered with an error). A command
//! longer than [`MAX_LINE`] is not kept, only counted through to its end. The nesting depth
//! saturates, so no input can overflow it.

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
    in_string: bool,
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
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
            }
            return None;
        }
        match b {
            b'"' => self.in_string = true,
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
