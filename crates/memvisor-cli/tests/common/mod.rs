//! What the CLI's integration tests share: a scratch directory of their own.

use std::path::PathBuf;

/// A fresh directory under the temporary directory, removed on drop. Named after the test and
/// the process, so tests of one binary and test binaries running side by side never share one.
pub struct Dir(PathBuf);

impl Dir {
    pub fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("memvisor-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    pub fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }

    /// A 16 MiB raw image.
    pub fn disk(&self) -> PathBuf {
        let p = self.join("disk.img");
        std::fs::File::create(&p)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
