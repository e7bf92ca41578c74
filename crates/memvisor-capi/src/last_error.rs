//! The thread's last error message, and the wrapper every exported function runs in.
//!
//! A failure is a [`Failure`]: the positive errno and the message. [`call`] runs an entry
//! point's body under `catch_unwind`, stores a failure's message in this thread's slot (a
//! `CString`, so C can read it in place) and returns `-errno`. A panic is a bug in memvisor,
//! never the caller's input: it becomes -EIO with the panic's text, and the handles stay as
//! they were before the call (the body takes them by reference).

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Why a call failed: a positive errno and what to tell the caller.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) errno: c_int,
    pub(crate) message: String,
}

impl Failure {
    /// -EINVAL for an argument only C can get wrong.
    pub(crate) fn invalid(message: String) -> Self {
        Failure {
            errno: libc::EINVAL,
            message,
        }
    }
}

impl From<memvisor::Error> for Failure {
    fn from(e: memvisor::Error) -> Self {
        Failure {
            errno: e.errno(),
            message: e.to_string(),
        }
    }
}

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Stores `function: message` as this thread's last error.
fn remember(function: &str, message: &str) {
    // A NUL inside the message would end it early in C: shown as a visible escape instead.
    let text = format!("{function}: {message}").replace('\0', "\\0");
    let text = CString::new(text).unwrap_or_default();
    // A call from a pthread key destructor runs after the thread's Rust thread-locals are
    // gone: the message is dropped there, never a panic (which could not unwind into C).
    let _ = LAST.try_with(|last| *last.borrow_mut() = text);
}

/// The message of this thread's last failure ("" before any, and on a thread whose
/// thread-locals are already torn down); valid until the next failing call on this thread.
pub(crate) fn last() -> *const c_char {
    LAST.try_with(|last| last.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// This thread's last message as Rust text (for tests).
#[cfg(test)]
pub(crate) fn last_text() -> String {
    LAST.with(|last| last.borrow().to_string_lossy().into_owned())
}

/// Runs `body` for the exported function `function`: its value on success, `-errno` (message
/// kept) on failure, -EIO on a panic.
pub(crate) fn call(function: &str, body: impl FnOnce() -> Result<c_int, Failure>) -> c_int {
    // The failure is turned into its return value inside the unwinding guard, so what crosses
    // it is a plain c_int: a `Result` with a `String` inside came back through memory, written
    // in halves and read whole, and the stalled load cost a translation a third of its time.
    let guarded = catch_unwind(AssertUnwindSafe(|| match body() {
        Ok(value) => value,
        Err(failure) => {
            remember(function, &failure.message);
            -failure.errno.abs().max(1)
        }
    }));
    match guarded {
        Ok(value) => value,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            remember(
                function,
                &format!("internal error in memvisor (please report it): {what}"),
            );
            -libc::EIO
        }
    }
}

/// Runs a body that cannot fail (a free, a getter) without letting a panic out; `fallback`
/// is returned if it panics.
pub(crate) fn call_infallible<T>(function: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        remember(function, "internal error in memvisor (please report it)");
        fallback
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_minus_errno_with_its_message() {
        let rc = call("f", || Err(Failure::invalid("size is 0".into())));
        assert_eq!(rc, -libc::EINVAL);
        assert_eq!(last_text(), "f: size is 0");
    }

    #[test]
    fn a_panic_is_eio_and_does_not_escape() {
        let rc = call("g", || panic!("boom"));
        assert_eq!(rc, -libc::EIO);
        assert!(last_text().contains("boom"), "{}", last_text());
        assert_eq!(call_infallible("h", 7u64, || panic!("x")), 7);
    }

    #[test]
    fn messages_are_per_thread() {
        call("here", || Err(Failure::invalid("mine".into())));
        std::thread::spawn(|| {
            call("there", || Err(Failure::invalid("theirs".into())));
        })
        .join()
        .unwrap();
        assert_eq!(last_text(), "here: mine");
    }
}
