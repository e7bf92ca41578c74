//! Every Markdown page that carries compiled Rust (README.md and docs/*.md) is a doctest.
//!
//! rustdoc compiles a page's code blocks only when the page is included as documentation
//! (`#[cfg(doctest)] #[doc = include_str!(...)]` in `src/lib.rs`). A page with a Rust block
//! that nobody includes would show code no compiler ever saw. This test reads each page's fenced
//! blocks the way rustdoc classifies them (an empty info string or only rustdoc's own
//! attributes is Rust; `ignore` is not compiled; any other word names another language) and
//! fails, naming the page, when a page with a compiled block is not included.

use std::fs;
use std::path::{Path, PathBuf};

/// The info-string words rustdoc reads as attributes of a Rust block.
const RUST_WORDS: &[&str] = &[
    "rust",
    "no_run",
    "should_panic",
    "compile_fail",
    "test_harness",
];

/// True when a fence's info string makes rustdoc compile the block.
fn compiled(info: &str) -> bool {
    let words: Vec<&str> = info
        .split([',', ' '])
        .map(str::trim)
        .filter(|w| !w.is_empty())
        .collect();
    !words.contains(&"ignore")
        && words
            .iter()
            .all(|w| RUST_WORDS.contains(w) || w.starts_with("edition"))
}

/// The info strings of the compiled blocks of one Markdown text.
fn compiled_blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut open: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let Some(rest) = trimmed.strip_prefix("```") else {
            continue;
        };
        match open.take() {
            Some(_) => {} // a closing fence
            None => {
                let info = rest.trim().to_string();
                if compiled(&info) {
                    out.push(info.clone());
                }
                open = Some(info);
            }
        }
    }
    out
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_classifier_reads_fences_as_rustdoc_does() {
    assert!(compiled(""));
    assert!(compiled("rust"));
    assert!(compiled("rust,no_run"));
    assert!(compiled("edition2021"));
    assert!(!compiled("rust,ignore"));
    assert!(!compiled("sh"));
    assert!(!compiled("text"));
    assert!(!compiled("json"));
    let page = "text\n```sh\nls\n```\n```rust\nfn main() {}\n```\n```\nfn f() {}\n```\n";
    assert_eq!(
        compiled_blocks(page),
        vec!["rust".to_string(), String::new()]
    );
}

#[test]
fn every_page_with_compiled_rust_is_a_doctest() {
    let root = workspace();
    // The core crate includes the pages of its own API; a page about another crate (docs/kvm.md:
    // memvisor-kvm) is included by that crate, which the core crate cannot depend on.
    let lib = [
        "crates/memvisor/src/lib.rs",
        "crates/memvisor-kvm/src/lib.rs",
    ]
    .iter()
    .map(|f| fs::read_to_string(root.join(f)).unwrap())
    .collect::<String>();
    let mut pages = vec![PathBuf::from("README.md")];
    let docs = fs::read_dir(root.join("docs")).expect("docs/ exists");
    for entry in docs {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            pages.push(Path::new("docs").join(name));
        }
    }
    let mut missing = Vec::new();
    for page in &pages {
        let text = fs::read_to_string(root.join(page)).unwrap();
        if compiled_blocks(&text).is_empty() {
            continue;
        }
        let include = format!("include_str!(\"../../../{}\")", page.display());
        if !lib.contains(&include) {
            missing.push(page.display().to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "pages with compiled Rust blocks that no crate's src/lib.rs includes as doctests: {missing:?}"
    );
}
