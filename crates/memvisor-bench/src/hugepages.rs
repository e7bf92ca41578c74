//! Growing the kernel's hugetlb pool for an experiment, and putting it back however
//! `memvisor bench` ends. Experiments get huge pages only through [`pool`] (never
//! `HugePageReservation::add` directly). What that guarantees for the size of the 2 MiB pool
//! (its sysfs `nr_hugepages`, which `/proc/sys/vm/nr_hugepages` also shows where 2 MiB is the
//! default huge page size):
//!
//! - the experiment returns or fails: the [`Reservation`] drops and memvisor's
//!   `HugePageReservation` takes back what it added;
//! - a panic: the workspace's profiles unwind, so the panic drops the reservation on its way
//!   out just the same (tested below). In a build with `panic = "abort"`, where nothing drops,
//!   a panic hook writes back the value the pool had before;
//! - SIGINT (Ctrl-C), SIGTERM or SIGHUP: a handler, installed with the first reservation, writes
//!   back the value the pool had before the first of the reservations alive, then lets the
//!   signal end the process as it would have (a shell sees status 128 + signal, 130 for Ctrl-C;
//!   tested in `tests/cli.rs`). A signal the parent set to be ignored (`nohup`, `&` in a
//!   script) stays ignored: the run goes on and ends as above.
//!
//! Not covered: SIGKILL, a crash of the kernel or the machine. Then write the old value back by
//! hand, e.g. `echo 0 > /proc/sys/vm/nr_hugepages`.

use std::ffi::CStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use memvisor::backing::free_huge_pages;
use memvisor::{HugePageReservation, PageSize};

/// The 2 MiB pool's size counter: the experiments use no other.
const NR_HUGEPAGES: &CStr = c"/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
/// Reservations alive.
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The pool's size before the first of the reservations alive.
static BEFORE: AtomicU64 = AtomicU64::new(0);
/// Serializes [`reserve`] and [`Reservation`]'s drop (the signal handler only reads).
static LOCK: Mutex<bool> = Mutex::new(false);

/// 2 MiB huge pages added to the pool for as long as this lives; see the module documentation.
#[derive(Debug)]
pub struct Reservation(Option<HugePageReservation>);

/// The 2 MiB huge pages a hugetlbfs backing of `count` of them needs: reserved for it as root
/// (`Some`), or already free (`None`); otherwise why not, for `Outcome::skipped`.
pub fn pool(count: u64) -> Result<Option<Reservation>, String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return reserve(count)
            .map(Some)
            .map_err(|e| format!("reserving {count} huge pages of 2 MiB failed: {e}"));
    }
    match free_huge_pages(PageSize::Size2M) {
        Ok(free) if free >= count => Ok(None),
        Ok(free) => Err(format!(
            "needs root to reserve {count} huge pages of 2 MiB ({free} free)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Adds `count` huge pages of 2 MiB to the pool (root only), as `HugePageReservation::add`
/// does, with the pool restored on signals and panics too.
fn reserve(count: u64) -> memvisor::Result<Reservation> {
    let mut installed = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !std::mem::replace(&mut *installed, true) {
        install_handlers();
    }
    if LIVE.load(Ordering::SeqCst) == 0 {
        let path = NR_HUGEPAGES.to_str().unwrap_or_default();
        let now = std::fs::read_to_string(path).map_err(|source| memvisor::Error::Os {
            op: "read nr_hugepages",
            source,
        })?;
        BEFORE.store(now.trim().parse().unwrap_or(0), Ordering::SeqCst);
    }
    // Counted before the pool grows, so that a signal from here on restores it.
    LIVE.fetch_add(1, Ordering::SeqCst);
    match HugePageReservation::add(PageSize::Size2M, count) {
        Ok(r) => Ok(Reservation(Some(r))),
        Err(e) => {
            LIVE.fetch_sub(1, Ordering::SeqCst);
            Err(e)
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let _lock = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // The pool shrinks first, then stops being guarded.
        drop(self.0.take());
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Writes the pool's earlier size back while a reservation is alive. Async-signal-safe:
/// atomics, `open`, `write`, `close`, and the number formatted on the stack.
fn restore() {
    if LIVE.load(Ordering::SeqCst) == 0 {
        return;
    }
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = BEFORE.load(Ordering::SeqCst);
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let text = &digits[at..];
    // SAFETY: the path is a NUL-terminated static string, `text` a live stack buffer of
    // `text.len()` bytes, and the descriptor ours until it is closed right after.
    unsafe {
        let fd = libc::open(NR_HUGEPAGES.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd >= 0 {
            libc::write(fd, text.as_ptr().cast(), text.len());
            libc::close(fd);
        }
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    restore();
    // SA_RESETHAND put the default action back: once this handler returns, the signal (blocked
    // while it runs) ends the process as it would have without us.
    // SAFETY: raise is async-signal-safe and only sends `sig` to this thread.
    unsafe { libc::raise(sig) };
}

fn install_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: all-zero sigactions are valid values to fill in; the handler calls only
        // async-signal-safe functions (see restore) and the structs outlive the calls.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut old);
            if old.sa_sigaction == libc::SIG_IGN {
                // Ignored by whoever started us (nohup, `&` in a script): it cannot end us.
                continue;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESETHAND;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
    #[cfg(panic = "abort")]
    {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nr_hugepages() -> u64 {
        let path = NR_HUGEPAGES.to_str().unwrap();
        std::fs::read_to_string(path)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn a_panic_gives_the_pages_back() {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            // Straight to stderr: libtest would capture an eprintln! of a passing test.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: a_panic_gives_the_pages_back needs root (it grows the hugetlb pool)"
            );
            return;
        }
        let before = nr_hugepages();
        let result = std::panic::catch_unwind(|| {
            let _pages = reserve(2).expect("reserve 2 huge pages");
            assert_eq!(nr_hugepages(), before + 2);
            assert_eq!(LIVE.load(Ordering::SeqCst), 1);
            panic!("an experiment panics");
        });
        assert!(result.is_err());
        assert_eq!(nr_hugepages(), before);
        assert_eq!(LIVE.load(Ordering::SeqCst), 0);
    }
}
