//! The servers' log: the `log` crate's records to stderr through `env_logger`, filtered by
//! `RUST_LOG`.
//!
//! Why env_logger and not tracing-subscriber: every crate here already logs through the `log`
//! facade (so do virtio-queue and vm-memory); env_logger is that facade's standard back end,
//! takes the `RUST_LOG` syntax users of Rust servers know (`info`, `warn,memvisor_vhost=debug`),
//! and adds two small crates, where tracing-subscriber would add a second facade to bridge.
//!
//! The model:
//! * `RUST_LOG` sets the filter; unset, everything at `info` and above is shown.
//! * `MEMVISOR_LOG`, this program's variable before it, is still read when `RUST_LOG` is unset
//!   (with a warning that it is deprecated); its values (`debug`, `info`, `warn`, ...) are
//!   `RUST_LOG` filters too, and it goes through the same checks.
//! * A filter that does not parse stops the server at start-up with an error naming the value:
//!   env_logger alone would print a warning and log with what it could make of it. A bare word
//!   that is neither a level nor a module that logs here (`RUST_LOG=debgu`) is refused too:
//!   env_logger would read it as a module name and show nothing else. A module that is not one
//!   of this program's (`RUST_LOG=info,hyper=debug`, set for another program) is only warned
//!   about.
//! * Each line: time (UTC, milliseconds), level, module, message. Under systemd the journal adds
//!   its own time; the line keeps its own for logs written to files.

use std::str::FromStr;

use anyhow::{Result, anyhow};

/// Crates whose records reach this program's log: a filter's module must start with one.
const KNOWN: &[&str] = &[
    "memvisor",
    "memvisor_cli",
    "memvisor_vhost",
    "memvisor_vfio_user",
    "memvisor_wire",
    "virtio_queue",
    "vm_memory",
];

/// Where the filter came from, and what it is.
fn filter_from_environment() -> Result<(String, String)> {
    if let Some(v) = std::env::var_os("RUST_LOG") {
        let v = v
            .into_string()
            .map_err(|v| anyhow!("RUST_LOG={v:?} is not UTF-8"))?;
        return Ok(("RUST_LOG".into(), v));
    }
    if let Some(v) = std::env::var_os("MEMVISOR_LOG") {
        let v = v
            .into_string()
            .map_err(|v| anyhow!("MEMVISOR_LOG={v:?} is not UTF-8"))?;
        return Ok(("MEMVISOR_LOG".into(), v));
    }
    Ok((String::new(), "info".into()))
}

/// Checks a filter; returns the names of modules it sets that no crate here logs under.
pub fn check_filter(var: &str, spec: &str) -> Result<Vec<String>> {
    let example = "e.g. RUST_LOG=info or RUST_LOG=warn,memvisor_vhost=debug";
    env_filter::Builder::new()
        .try_parse(spec)
        .map_err(|e| anyhow!("{var}={spec:?} cannot be used: {e}; {example}"))?;
    let mut unknown = Vec::new();
    let directives = spec.split('/').next().unwrap_or_default();
    for d in directives
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        let (module, level) = match d.split_once('=') {
            Some((m, l)) => (m.trim(), Some(l.trim())),
            None => (d, None),
        };
        if level.is_none() && log::LevelFilter::from_str(module).is_ok() {
            continue;
        }
        let krate = module.split("::").next().unwrap_or_default();
        if KNOWN.contains(&krate) {
            continue;
        }
        if level.is_none() {
            // A bare word: env_logger would show that module alone, at every level.
            return Err(anyhow!(
                "{var}={spec:?}: {module:?} is neither a level (off, error, warn, info, debug, \
                 trace) nor a module of this program ({}); {example}",
                KNOWN.join(", ")
            ));
        }
        unknown.push(module.to_string());
    }
    Ok(unknown)
}

/// Starts the log; an unusable filter is an error naming it.
pub fn init() -> Result<()> {
    let (var, spec) = filter_from_environment()?;
    let shown = if var.is_empty() { "RUST_LOG" } else { &var };
    let unknown = check_filter(shown, &spec)?;
    let mut b = env_logger::Builder::new();
    b.parse_filters(&spec)
        .format_timestamp_millis()
        .target(env_logger::Target::Stderr);
    // A second init (tests run several servers in one process) keeps the first logger.
    let _ = b.try_init();
    if var == "MEMVISOR_LOG" {
        log::warn!("MEMVISOR_LOG is deprecated: use RUST_LOG={spec} (same values)");
    }
    if !unknown.is_empty() {
        log::warn!(
            "{shown}={spec:?} sets {}, which nothing in this program logs under (its modules \
             start with {})",
            unknown.join(", "),
            KNOWN.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_filter;

    #[test]
    fn filters_that_parse_pass_and_others_are_refused_by_name() {
        for good in [
            "info",
            "DEBUG",
            "warn,memvisor_vhost=debug",
            "memvisor_vhost::backend=trace",
            "off",
            "",
        ] {
            assert_eq!(
                check_filter("RUST_LOG", good).unwrap(),
                Vec::<String>::new()
            );
        }
        assert_eq!(
            check_filter("RUST_LOG", "info,hyper=debug").unwrap(),
            vec!["hyper".to_string()]
        );
        for (bad, says) in [
            ("memvisor=loud", "invalid logging spec 'loud'"),
            ("a=b=c", "invalid logging spec"),
            ("info/x/y", "too many '/'s"),
            ("debgu", "\"debgu\" is neither a level"),
        ] {
            let e = check_filter("RUST_LOG", bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(e.contains(&format!("RUST_LOG={bad:?}")), "{bad}: {e}");
        }
    }
}
