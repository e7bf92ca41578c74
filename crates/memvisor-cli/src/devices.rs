//! What `memvisor serve` is asked to serve: its devices and their options, from the command line
//! or a configuration file, under the same names in both.
//!
//! **One form.** Each device is a list of `name=value` options, QEMU's style:
//! `--blk socket=run/disk.sock,disk=vm.img,queues=2,direct=on` and
//! `--balloon socket=run/balloon.sock,stats-interval=1,deflate-on-oom=on`. As in QEMU, the first
//! option's name may be left out: a first element with no `=` is the `socket`
//! (`--balloon run/balloon.sock`). A configuration file (`--config FILE`, JSON) holds the same
//! options as objects under the same names, a list per device type, beside the server-wide
//! settings:
//!
//! ```json
//! { "blk": [ { "socket": "run/disk.sock", "disk": "vm.img", "queues": 2, "direct": true } ],
//!   "balloon": [ { "socket": "run/balloon.sock", "stats-interval": 1 } ],
//!   "control": "run/memvisor.ctl", "iommu": false, "long-term-pins": false }
//! ```
//!
//! Both go through one parser ([`Options`]): a JSON value becomes the text the command line
//! would carry (`true` is `on`), so a value is checked, and an error worded, the same way
//! wherever it came from. An unknown name, a missing `disk`, a value out of range or a name
//! given twice is refused with the option and the value named.
//!
//! **Where a device listens** ([`SocketSpec`], the vhost-user conventions' `--socket-path` /
//! `--fd` per device): `socket=PATH`, or `fd=N` (an inherited listening socket; not with
//! `socket=`), or neither: then `serve`'s own `--socket-path` / `--fd` if this is the one
//! device that leaves its socket out, else a socket systemd passed, named after the device's
//! id in `LISTEN_FDNAMES` (`crate::listener::open_device`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use memvisor_vhost::BlkOptions;

use crate::listener::SocketSpec;
use memvisor_vhost::image_format::FormatChoice;
use memvisor_vhost::image_lock::Locking;

/// One device's options, in order, as `(name, value)`: from one command-line argument or one
/// configuration-file object.
#[derive(Debug)]
pub struct Options {
    /// Where they came from, for errors: `--blk "…"` or `config.json: blk[0]`.
    origin: String,
    pairs: Vec<(String, String)>,
}

impl Options {
    /// Splits a command-line argument `a=1,b=2` (a first element without `=` is `socket`).
    pub fn parse(flag: &str, arg: &str) -> Result<Options> {
        let origin = format!("{flag} {arg:?}");
        let mut pairs = Vec::new();
        for (i, part) in arg.split(',').enumerate() {
            match part.split_once('=') {
                Some((k, v)) => pairs.push((k.to_string(), v.to_string())),
                None if i == 0 && !part.is_empty() => pairs.push(("socket".into(), part.into())),
                None => bail!("{origin}: option {part:?} has no value; write NAME=VALUE"),
            }
        }
        Ok(Options { origin, pairs })
    }

    /// One configuration-file object: strings as they are, numbers in decimal, booleans as
    /// `on`/`off`.
    pub fn from_json(origin: String, value: &serde_json::Value) -> Result<Options> {
        let Some(map) = value.as_object() else {
            bail!("{origin}: a device is an object of options, not {value}");
        };
        let mut pairs = Vec::new();
        for (k, v) in map {
            let text = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => if *b { "on" } else { "off" }.to_string(),
                other => bail!("{origin}: option {k:?} is {other}; a string, number or boolean"),
            };
            pairs.push((k.clone(), text));
        }
        Ok(Options { origin, pairs })
    }

    /// Takes the option `name` out, if given (refusing one given twice).
    fn take(&mut self, name: &str) -> Result<Option<String>> {
        let mut found = None;
        let mut rest = Vec::new();
        for (k, v) in std::mem::take(&mut self.pairs) {
            if k == name {
                if found.is_some() {
                    bail!("{}: option {name:?} is given twice", self.origin);
                }
                found = Some(v);
            } else {
                rest.push((k, v));
            }
        }
        self.pairs = rest;
        Ok(found)
    }

    /// `socket=PATH` or `fd=N` (not both), or neither ([`SocketSpec::Activated`]).
    fn socket(&mut self) -> Result<SocketSpec> {
        let path = self.take("socket")?;
        let fd = self.number("fd", 0..=i32::MAX, "a descriptor number")?;
        match (path, fd) {
            (Some(_), Some(_)) => bail!(
                "{}: socket= and fd= both name the device's socket; give one",
                self.origin
            ),
            (Some(p), None) if p.is_empty() => bail!("{}: socket= is empty", self.origin),
            (Some(p), None) => Ok(SocketSpec::Path(PathBuf::from(p))),
            (None, Some(fd)) => Ok(SocketSpec::Fd(fd)),
            (None, None) => Ok(SocketSpec::Activated),
        }
    }

    fn required(&mut self, name: &str, example: &str) -> Result<String> {
        match self.take(name)? {
            Some(v) if !v.is_empty() => Ok(v),
            _ => bail!("{}: {name}=… is missing, {example}", self.origin),
        }
    }

    fn on_off(&mut self, name: &str) -> Result<Option<bool>> {
        let Some(v) = self.take(name)? else {
            return Ok(None);
        };
        match v.as_str() {
            "on" | "true" | "yes" => Ok(Some(true)),
            "off" | "false" | "no" => Ok(Some(false)),
            _ => bail!("{}: {name}={v:?}: write on or off", self.origin),
        }
    }

    fn number<T: std::str::FromStr + PartialOrd + std::fmt::Display>(
        &mut self,
        name: &str,
        range: std::ops::RangeInclusive<T>,
        unit: &str,
    ) -> Result<Option<T>> {
        let Some(v) = self.take(name)? else {
            return Ok(None);
        };
        match v.parse::<T>() {
            Ok(n) if range.contains(&n) => Ok(Some(n)),
            _ => bail!(
                "{}: {name}={v:?}: {unit}, {} to {}",
                self.origin,
                range.start(),
                range.end()
            ),
        }
    }

    /// Refuses what no device option took.
    fn finish(self, known: &str) -> Result<()> {
        match self.pairs.first() {
            None => Ok(()),
            Some((k, _)) => bail!("{}: unknown option {k:?}; known: {known}", self.origin),
        }
    }
}

/// One block device: `socket=PATH|fd=N,disk=FILE[,id=NAME][,queues=N][,read-only=on|off]
/// [,serial=TEXT][,direct=on|off][,poll-us=N][,locking=on|off|auto][,format=raw]
/// [,fixed-buffers=on|off]`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlkSpec {
    /// The name the control socket knows it by (default `blk0`, `blk1`, ... in order).
    pub id: Option<String>,
    /// vhost-user socket: `socket=PATH`, `fd=N`, or neither (module documentation).
    pub socket: SocketSpec,
    /// Raw image.
    pub disk: PathBuf,
    /// Queues, read-only, serial, polling (the IOMMU choice is the whole server's). An empty
    /// serial means the default: the device's id ([`default_serial`]).
    pub options: BlkOptions,
    /// Open the image `O_DIRECT`.
    pub direct: bool,
    /// QEMU's image locks (`locking=`; [`memvisor_vhost::image_lock`]).
    pub locking: Locking,
    /// `format=raw`, or look for another format's header ([`memvisor_vhost::image_format`]).
    pub format: FormatChoice,
}

impl BlkSpec {
    const KNOWN: &'static str = "socket, fd, disk, id, queues, read-only, serial, direct, poll-us, locking, format, \
         fixed-buffers";
    const EXAMPLE: &'static str =
        "e.g. --blk socket=run/blk.sock,disk=disk.img,queues=2,serial=disk0,direct=on";

    /// The device the options describe.
    pub fn from_options(mut o: Options) -> Result<BlkSpec> {
        let socket = o.socket()?;
        let disk = PathBuf::from(o.required("disk", Self::EXAMPLE)?);
        let mut options = BlkOptions {
            serial: String::new(),
            ..BlkOptions::default()
        };
        if let Some(q) = o.number("queues", 1..=64u16, "a number of queues")? {
            options.queues = q;
        }
        if let Some(r) = o.on_off("read-only")? {
            options.read_only = r;
        }
        if let Some(p) = o.number("poll-us", 0..=1_000_000u32, "microseconds")? {
            options.poll_us = p;
        }
        if o.on_off("fixed-buffers")?.unwrap_or(false) {
            if let Err(why) = memvisor_vhost::blk::probe_fixed_buffers() {
                bail!("{}: fixed-buffers=on: {why}; leave it off", o.origin);
            }
            options.fixed_buffers = true;
        }
        if let Some(s) = o.take("serial")? {
            if s.len() > 20 {
                bail!(
                    "{}: serial {s:?} is {} bytes; virtio-blk's GET_ID holds 20",
                    o.origin,
                    s.len()
                );
            }
            options.serial = s;
        }
        let direct = o.on_off("direct")?.unwrap_or(false);
        let locking = match o.take("locking")? {
            Some(v) => v.parse().map_err(|e| anyhow!("{}: {e}", o.origin))?,
            None => Locking::default(),
        };
        let format = match o.take("format")? {
            Some(v) => v.parse().map_err(|e| anyhow!("{}: {e}", o.origin))?,
            None => FormatChoice::default(),
        };
        let id = o.take("id")?;
        o.finish(Self::KNOWN)?;
        Ok(BlkSpec {
            id,
            socket,
            disk,
            options,
            direct,
            locking,
            format,
        })
    }
}

/// The serial a blk device answers `GET_ID` with when none is given: its id (`blk0`, `blk1`,
/// ... or `id=`), which no other device of the process has; an id longer than virtio-blk's 20
/// bytes becomes `mv-` and 16 hex digits of a hash of it (FNV-1a, stable across runs and
/// builds).
pub fn default_serial(id: &str) -> String {
    if id.len() <= 20 {
        return id.to_string();
    }
    hashed_serial(id.as_bytes())
}

/// The serial `vhost-user-blk` answers `GET_ID` with when none is given: `mv-` and 16 hex
/// digits of a hash of the disk's canonical path (the path as given where it cannot be made
/// canonical). One back end serves one disk, so an id would be the same in every back end;
/// the path tells their disks apart and stays the same across restarts.
pub fn path_serial(disk: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let path = std::fs::canonicalize(disk).unwrap_or_else(|_| disk.to_path_buf());
    hashed_serial(path.as_os_str().as_bytes())
}

/// `mv-` and the FNV-1a hash of `bytes` in 16 hex digits (19 bytes, within GET_ID's 20): stable
/// across runs, builds and Rust versions, unlike std's hasher.
fn hashed_serial(bytes: &[u8]) -> String {
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("mv-{hash:016x}")
}

impl std::str::FromStr for BlkSpec {
    type Err = anyhow::Error;

    fn from_str(arg: &str) -> Result<BlkSpec> {
        BlkSpec::from_options(Options::parse("--blk", arg)?)
    }
}

/// One balloon: `socket=PATH|fd=N[,id=NAME][,target-mib=N][,reporting=on|off]
/// [,stats-interval=SECS][,deflate-on-oom=on|off]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalloonSpec {
    /// The name the control socket knows it by (default `balloon0`, `balloon1`, ...).
    pub id: Option<String>,
    /// vhost-user socket: `socket=PATH`, `fd=N`, or neither (module documentation).
    pub socket: SocketSpec,
    /// The target it starts with, MiB (changed at run time with `balloon-set-target`).
    pub target_mib: u32,
    /// Offer free page reporting (on by default).
    pub reporting: bool,
    /// Offer the statistics queue, polled every this many seconds (0: not offered).
    pub stats_interval_secs: u32,
    /// Offer deflate on OOM (off by default, as in QEMU).
    pub deflate_on_oom: bool,
}

impl BalloonSpec {
    const KNOWN: &'static str =
        "socket, fd, id, target-mib, reporting, stats-interval, deflate-on-oom";

    /// The device the options describe.
    pub fn from_options(mut o: Options) -> Result<BalloonSpec> {
        let socket = o.socket()?;
        let spec = BalloonSpec {
            id: o.take("id")?,
            socket,
            // A target beyond u32 pages cannot be told to the driver.
            target_mib: o
                .number("target-mib", 0..=u32::MAX / 256, "MiB")?
                .unwrap_or(0),
            reporting: o.on_off("reporting")?.unwrap_or(true),
            stats_interval_secs: o
                .number("stats-interval", 0..=86_400u32, "seconds")?
                .unwrap_or(0),
            deflate_on_oom: o.on_off("deflate-on-oom")?.unwrap_or(false),
        };
        o.finish(Self::KNOWN)?;
        Ok(spec)
    }
}

impl std::str::FromStr for BalloonSpec {
    type Err = anyhow::Error;

    fn from_str(arg: &str) -> Result<BalloonSpec> {
        BalloonSpec::from_options(Options::parse("--balloon", arg)?)
    }
}

/// A configuration file's contents: devices and the server-wide settings, under the command
/// line's names.
#[derive(Debug, Default, PartialEq)]
pub struct Config {
    pub blk: Vec<BlkSpec>,
    pub balloon: Vec<BalloonSpec>,
    pub control: Option<PathBuf>,
    pub iommu: bool,
    pub long_term_pins: bool,
    pub stats: Option<PathBuf>,
}

impl Config {
    /// Reads a JSON configuration file.
    pub fn read(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the configuration file {}", path.display()))?;
        Config::parse(&path.display().to_string(), &text)
    }

    /// Parses a configuration (`name` says where it came from, for errors).
    pub fn parse(name: &str, text: &str) -> Result<Config> {
        let value: serde_json::Value =
            serde_json::from_str(text).with_context(|| format!("{name} is not JSON"))?;
        let Some(top) = value.as_object() else {
            bail!(
                "{name}: the configuration is an object (\"blk\", \"balloon\", \"control\", ...)"
            );
        };
        let mut c = Config::default();
        for (key, v) in top {
            let list = |kind: &str| -> Result<Vec<Options>> {
                let items = v
                    .as_array()
                    .ok_or_else(|| anyhow!("{name}: {kind:?} is a list of devices"))?;
                items
                    .iter()
                    .enumerate()
                    .map(|(i, d)| Options::from_json(format!("{name}: {kind}[{i}]"), d))
                    .collect()
            };
            let flag = |v: &serde_json::Value| {
                v.as_bool()
                    .ok_or_else(|| anyhow!("{name}: {key:?} is true or false, not {v}"))
            };
            let path = |v: &serde_json::Value| {
                v.as_str()
                    .map(PathBuf::from)
                    .ok_or_else(|| anyhow!("{name}: {key:?} is a path, not {v}"))
            };
            match key.as_str() {
                "blk" => {
                    for o in list("blk")? {
                        c.blk.push(BlkSpec::from_options(o)?);
                    }
                }
                "balloon" => {
                    for o in list("balloon")? {
                        c.balloon.push(BalloonSpec::from_options(o)?);
                    }
                }
                "control" => c.control = Some(path(v)?),
                "stats" => c.stats = Some(path(v)?),
                "iommu" => c.iommu = flag(v)?,
                "long-term-pins" => c.long_term_pins = flag(v)?,
                other => bail!(
                    "{name}: unknown setting {other:?}; known: blk, balloon, control, stats, \
                     iommu, long-term-pins"
                ),
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blk_spec_takes_per_disk_options_and_names_what_it_refuses() {
        let s: BlkSpec =
            "socket=run/a.sock,disk=disk.img,queues=2,serial=disk0,direct=on,read-only=on,id=d"
                .parse()
                .unwrap();
        assert_eq!(s.socket, SocketSpec::Path("run/a.sock".into()));
        assert_eq!(s.disk.to_str(), Some("disk.img"));
        assert_eq!((s.options.queues, s.options.serial.as_str()), (2, "disk0"));
        assert!(s.direct && s.options.read_only);
        assert_eq!(s.id.as_deref(), Some("d"));
        // The socket's name may be left out, as QEMU's first option.
        let plain: BlkSpec = "a.sock,disk=d.img".parse().unwrap();
        assert_eq!(plain.socket, SocketSpec::Path("a.sock".into()));
        // fd=N instead of a path; neither: a socket systemd passes.
        let fd: BlkSpec = "fd=5,disk=d.img".parse().unwrap();
        assert_eq!(fd.socket, SocketSpec::Fd(5));
        let none: BlkSpec = "disk=d.img,id=vm1".parse().unwrap();
        assert_eq!(none.socket, SocketSpec::Activated);
        // No serial given: empty, which serving turns into the device's id.
        assert_eq!(
            plain.options,
            memvisor_vhost::BlkOptions {
                serial: String::new(),
                ..Default::default()
            }
        );
        assert!(!plain.direct && plain.id.is_none());
        assert_eq!(
            (plain.locking, plain.format),
            (Locking::Auto, FormatChoice::Probe)
        );
        let l: BlkSpec = "a.sock,disk=d.img,locking=off,format=raw".parse().unwrap();
        assert_eq!((l.locking, l.format), (Locking::Off, FormatChoice::Raw));
        let l: BlkSpec = "a.sock,disk=d.img,locking=on".parse().unwrap();
        assert_eq!(l.locking, Locking::On);
        for (bad, says) in [
            ("a.sock", "disk=… is missing"),
            ("a.sock=d.img", "disk=… is missing"),
            ("socket=a,fd=4,disk=d", "socket= and fd= both"),
            ("fd=x,disk=d", "fd=\"x\": a descriptor number"),
            ("socket=a,disk=d,queues=0", "queues=\"0\""),
            ("socket=a,disk=d,queues=65", "queues=\"65\""),
            ("socket=a,disk=d,direct=maybe", "on or off"),
            ("socket=a,disk=d,serial=123456789012345678901", "21 bytes"),
            ("socket=a,disk=d,cache=none", "unknown option \"cache\""),
            ("socket=a,disk=d,queues", "has no value"),
            ("socket=a,disk=d,disk=e", "given twice"),
            (
                "socket=a,disk=d,locking=maybe",
                "locking=\"maybe\": write on, off or auto",
            ),
            (
                "socket=a,disk=d,format=qcow2",
                "format=\"qcow2\": memvisor serves raw",
            ),
        ] {
            let e = bad.parse::<BlkSpec>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn default_serials_are_the_ids_and_fit_get_id() {
        assert_eq!(default_serial("blk0"), "blk0");
        assert_eq!(default_serial("blk1"), "blk1");
        assert_eq!(
            default_serial("12345678901234567890"),
            "12345678901234567890"
        );
        let long = "a-device-id-longer-than-twenty";
        let a = default_serial(long);
        assert_eq!((a.len(), &a[..3]), (19, "mv-"));
        assert_eq!(a, default_serial(long), "stable");
        assert_ne!(a, default_serial("a-device-id-longer-than-twentY"));
    }

    #[test]
    fn a_path_serial_is_stable_fits_get_id_and_tells_disks_apart() {
        // FNV-1a of "/a": fixed by the algorithm, so a serial never changes across builds.
        assert_eq!(hashed_serial(b"/a"), "mv-07d66707b49cd92d");
        let a = path_serial(std::path::Path::new("/nonexistent/disk-a.img"));
        let b = path_serial(std::path::Path::new("/nonexistent/disk-b.img"));
        assert_eq!((a.len(), &a[..3]), (19, "mv-"));
        assert_ne!(a, b);
        // The canonical path counts: another spelling of one file is the same disk.
        let dir = std::env::temp_dir();
        let canon = std::fs::canonicalize(&dir).unwrap();
        assert_eq!(path_serial(&dir.join(".")), path_serial(&canon));
    }

    #[test]
    fn a_balloon_spec_takes_its_options_with_qemus_defaults() {
        let b: BalloonSpec = "run/b.sock".parse().unwrap();
        assert_eq!(
            b,
            BalloonSpec {
                id: None,
                socket: SocketSpec::Path("run/b.sock".into()),
                target_mib: 0,
                reporting: true,
                stats_interval_secs: 0,
                deflate_on_oom: false,
            }
        );
        let b: BalloonSpec =
            "socket=b.sock,target-mib=256,reporting=off,stats-interval=2,deflate-on-oom=on"
                .parse()
                .unwrap();
        assert_eq!(
            (
                b.target_mib,
                b.reporting,
                b.stats_interval_secs,
                b.deflate_on_oom
            ),
            (256, false, 2, true)
        );
        for (bad, says) in [
            ("b.sock,target-mib=16777216", "target-mib=\"16777216\""),
            ("b.sock,stats-interval=-1", "stats-interval=\"-1\""),
            ("b.sock,queues=2", "unknown option \"queues\""),
            ("fd=3,socket=b", "socket= and fd= both"),
        ] {
            let e = bad.parse::<BalloonSpec>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_config_file_says_what_the_command_line_says_under_the_same_names() {
        let c = Config::parse(
            "c.json",
            r#"{"blk": [{"socket": "a.sock", "disk": "a.img", "queues": 2, "direct": true,
                         "id": "root", "locking": false, "format": "raw"}],
                "balloon": [{"socket": "b.sock", "stats-interval": 1, "deflate-on-oom": true}],
                "control": "ctl.sock", "iommu": true}"#,
        )
        .unwrap();
        let blk: BlkSpec =
            "socket=a.sock,disk=a.img,queues=2,direct=on,id=root,locking=off,format=raw"
                .parse()
                .unwrap();
        let balloon: BalloonSpec = "b.sock,stats-interval=1,deflate-on-oom=on".parse().unwrap();
        assert_eq!(c.blk, vec![blk]);
        assert_eq!(c.balloon, vec![balloon]);
        assert_eq!(c.control, Some(PathBuf::from("ctl.sock")));
        assert!(c.iommu && !c.long_term_pins);
        for (bad, says) in [
            ("[]", "is an object"),
            (r#"{"blk": {}}"#, "list of devices"),
            (
                r#"{"blk": [{"socket": "a"}]}"#,
                "c.json: blk[0]: disk=… is missing",
            ),
            (
                r#"{"blk": [{"socket": "a", "disk": "d", "queues": [1]}]}"#,
                "option \"queues\"",
            ),
            (
                r#"{"balloon": [{"socket": "b", "stats-interval": 1.5}]}"#,
                "stats-interval=\"1.5\"",
            ),
            (r#"{"iommu": "yes"}"#, "true or false"),
            (r#"{"disks": []}"#, "unknown setting \"disks\""),
            ("{", "not JSON"),
        ] {
            let e = format!("{:#}", Config::parse("c.json", bad).unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
