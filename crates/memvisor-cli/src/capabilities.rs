//! `--print-capabilities`: what each server tells management software (libvirt) about itself,
//! in the JSON of the vhost-user specification's `VHostUserBackendCapabilities`
//! (docs/interop/vhost-user.json in QEMU): `{"type": ..., "features": [...]}`.
//!
//! The model: a feature is listed only when the command line option it names in the schema
//! exists and works here. `vhost-user-blk` is a back end of type `block` with `--read-only` and
//! `--blk-file` (an alias of `--disk`). `serve` hosts several devices in one process, which the
//! specification's one-device back ends do not: it prints a JSON array with one object per type
//! it can host (`block`, `balloon`), with no schema features (its per-disk options are not the
//! schema's `--read-only` and `--blk-file`). `vfio-user` has no schema in the vfio-user
//! specification; it prints the same shape with `"type": "vfio-user"` and the device it serves.

use serde_json::{Value, json};

/// `memvisor vhost-user-blk --print-capabilities`.
pub fn vhost_user_blk() -> Value {
    json!({ "type": "block", "features": ["read-only", "blk-file"] })
}

/// `memvisor serve --print-capabilities`: one object per device type it hosts.
pub fn serve() -> Value {
    json!([
        { "type": "block", "features": [] },
        { "type": "balloon", "features": [] },
    ])
}

/// `memvisor vfio-user --print-capabilities`.
pub fn vfio_user() -> Value {
    json!({ "type": "vfio-user", "device": "mvdma", "features": [] })
}
