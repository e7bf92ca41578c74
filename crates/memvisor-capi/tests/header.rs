//! include/memvisor.h against src/api.rs: the same functions with the same argument and return
//! types, the same struct fields, the same constant values. A function added on one side only,
//! an argument changed, a field reordered or a constant renumbered fails here; gcc then checks
//! the header compiles (c/run.sh, `-Wall -Wextra -Werror`) and the linker that every declared
//! name exists in libmemvisor.so and libmemvisor.a.
//!
//! Both files are read as text: the header with its comments stripped, the Rust source for
//! `extern "C" fn`, `#[repr(C)]` structs and the `MEMVISOR_*` constants' Rust names. Rust types
//! are spelled in C by a small table (`c_type`); a type outside it fails the test, so a new
//! kind of argument must be taught here first.

use std::collections::BTreeMap;

const HEADER: &str = include_str!("../include/memvisor.h");
const API: &str = include_str!("../src/api.rs");

/// Text without C comments (each replaced by the newlines it held), preprocessor lines, and
/// the C++ guard's `extern "C" {` / `}`.
fn strip_c(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("/*") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find("*/").expect("unterminated comment") + start + 2;
        out.push(' ');
        out.push_str(&"\n".repeat(rest[start..end].matches('\n').count()));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out.lines()
        .filter(|l| {
            let l = l.trim();
            !l.starts_with('#') && l != "extern \"C\" {" && l != "}"
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A C type in one spelling: `const memvisor_dma*`, `uint64_t`, `void**`.
fn norm(c: &str) -> String {
    let mut s = c.split_whitespace().collect::<Vec<_>>().join(" ");
    s = s.replace(" *", "*").replace("* ", "*");
    s
}

/// A C declaration `type name` split into (type, name).
fn split_decl(decl: &str) -> (String, String) {
    let decl = decl.trim();
    let at = decl
        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    (norm(&decl[..at]), decl[at..].to_string())
}

/// The C spelling of a Rust FFI type.
fn c_type(rust: &str) -> String {
    let rust = rust.trim();
    let mut rest = rust;
    let mut levels = Vec::new();
    loop {
        if let Some(r) = rest.strip_prefix("*mut ") {
            levels.push(false);
            rest = r.trim_start();
        } else if let Some(r) = rest.strip_prefix("*const ") {
            levels.push(true);
            rest = r.trim_start();
        } else {
            break;
        }
    }
    let base = match rest {
        "c_int" => "int".to_string(),
        "c_char" => "char".to_string(),
        "c_void" => "void".to_string(),
        "u64" => "uint64_t".to_string(),
        "u32" => "uint32_t".to_string(),
        "usize" => "size_t".to_string(),
        "()" => "void".to_string(),
        name if name.starts_with("Memvisor") => {
            // MemvisorSgBuf -> memvisor_sg_buf
            let mut s = String::new();
            for (i, ch) in name.chars().enumerate() {
                if ch.is_uppercase() && i > 0 {
                    s.push('_');
                }
                s.push(ch.to_ascii_lowercase());
            }
            s
        }
        other => panic!("no C spelling for the Rust type {other:?}: teach c_type"),
    };
    let Some((&innermost, outer)) = levels.split_last() else {
        return base;
    };
    assert!(
        outer.iter().all(|c| !c),
        "{rust}: const outer pointers have no spelling here"
    );
    let konst = if innermost { "const " } else { "" };
    norm(&format!("{konst}{base}{}", "*".repeat(levels.len())))
}

/// name -> (return type, argument types), from the header.
fn header_functions() -> BTreeMap<String, (String, Vec<String>)> {
    let text = strip_c(HEADER);
    let mut out = BTreeMap::new();
    for stmt in text.split(';') {
        let stmt = stmt.trim();
        if stmt.contains("typedef") || stmt.contains('{') {
            continue;
        }
        let Some(open) = stmt.find('(') else { continue };
        let (ret, name) = split_decl(&stmt[..open]);
        if !name.starts_with("memvisor_") {
            continue;
        }
        let close = stmt.rfind(')').expect("a prototype ends with ')'");
        let args: Vec<String> = stmt[open + 1..close]
            .split(',')
            .map(|a| a.trim())
            .filter(|a| *a != "void" && !a.is_empty())
            .map(|a| split_decl(a).0)
            .collect();
        assert!(
            out.insert(name.clone(), (ret, args)).is_none(),
            "{name} declared twice"
        );
    }
    out
}

/// name -> (return type, argument types), from the Rust source, in C spelling.
fn rust_functions() -> BTreeMap<String, (String, Vec<String>)> {
    let text = API.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = BTreeMap::new();
    for piece in text.split("extern \"C\" fn ").skip(1) {
        let open = piece.find('(').unwrap();
        let name = piece[..open].trim().to_string();
        // Arguments never hold parentheses; the body starts at the first '{'.
        let close = piece.find(')').unwrap();
        let args = piece[open + 1..close]
            .split(',')
            .filter(|a| !a.trim().is_empty())
            .map(|a| c_type(a.split_once(':').expect("name: type").1))
            .collect();
        let sig_end = piece.find('{').unwrap();
        let ret = piece[close + 1..sig_end]
            .trim()
            .strip_prefix("->")
            .map_or("void".to_string(), c_type);
        assert!(
            out.insert(name.clone(), (ret, args)).is_none(),
            "{name} defined twice"
        );
    }
    out
}

#[test]
fn every_function_has_the_same_prototype_on_both_sides() {
    let header = header_functions();
    let rust = rust_functions();
    assert!(
        header.len() >= 40,
        "only {} prototypes parsed",
        header.len()
    );
    let only_header: Vec<_> = header.keys().filter(|k| !rust.contains_key(*k)).collect();
    let only_rust: Vec<_> = rust.keys().filter(|k| !header.contains_key(*k)).collect();
    assert!(
        only_header.is_empty() && only_rust.is_empty(),
        "declared in memvisor.h only: {only_header:?}; defined in api.rs only: {only_rust:?}"
    );
    for (name, h) in &header {
        assert_eq!(
            &rust[name], h,
            "{name}: api.rs (left) and memvisor.h (right) differ"
        );
    }
}

/// struct name -> [(type, field)], from `typedef struct x { ... } x;` in the header.
fn header_structs() -> BTreeMap<String, Vec<(String, String)>> {
    let text = strip_c(HEADER);
    let mut out = BTreeMap::new();
    for piece in text.split("typedef struct ").skip(1) {
        let Some(open) = piece.find('{') else {
            continue;
        };
        if piece[..open].contains(';') {
            continue; // an opaque handle: `typedef struct x x;`
        }
        let name = piece[..open].trim().to_string();
        let close = piece.find('}').unwrap();
        let fields = piece[open + 1..close]
            .split(';')
            .filter(|f| !f.trim().is_empty())
            .map(|f| {
                let (t, n) = split_decl(f);
                (t, n)
            })
            .collect();
        out.insert(name, fields);
    }
    out
}

/// The same from the `#[repr(C)]` structs of api.rs.
fn rust_structs() -> BTreeMap<String, Vec<(String, String)>> {
    let mut out = BTreeMap::new();
    for piece in API.split("#[repr(C)]").skip(1) {
        let start = piece.find("pub struct ").unwrap() + "pub struct ".len();
        let open = piece.find('{').unwrap();
        let name = c_type(piece[start..open].trim());
        let close = piece.find('}').unwrap();
        let fields = piece[open + 1..close]
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("pub "))
            .map(|l| {
                let (n, t) = l.trim_start_matches("pub ").split_once(':').unwrap();
                (c_type(t.trim().trim_end_matches(',')), n.trim().to_string())
            })
            .collect();
        out.insert(name, fields);
    }
    out
}

#[test]
fn every_struct_has_the_same_fields_in_the_same_order() {
    let header = header_structs();
    let rust = rust_structs();
    assert_eq!(
        header.keys().collect::<Vec<_>>(),
        rust.keys().collect::<Vec<_>>(),
        "structs of memvisor.h (left) and api.rs (right)"
    );
    for (name, fields) in &header {
        assert_eq!(
            &rust[name], fields,
            "struct {name}: api.rs (left), memvisor.h (right)"
        );
    }
}

#[test]
fn every_constant_has_the_same_value() {
    let mut defines = BTreeMap::new();
    for line in HEADER.lines() {
        let mut words = line.split_whitespace();
        if words.next() == Some("#define") {
            if let (Some(name), Some(value)) = (words.next(), words.next()) {
                if let Ok(v) = value.trim_end_matches('u').parse::<u64>() {
                    defines.insert(name.to_string(), v);
                }
            }
        }
    }
    let mut seen = 0;
    for line in API.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("const ") else {
            continue;
        };
        let Some((name, value)) = rest.split_once(':') else {
            continue;
        };
        if !name.starts_with(|c: char| c.is_ascii_uppercase())
            || !name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        {
            continue; // `const fn`, `const _`
        }
        let value: u64 = value
            .split('=')
            .nth(1)
            .unwrap()
            .trim()
            .trim_end_matches(';')
            .parse()
            .unwrap();
        let c_name = format!("MEMVISOR_{name}");
        assert_eq!(
            defines.get(&c_name),
            Some(&value),
            "{c_name}: api.rs says {value}"
        );
        seen += 1;
    }
    assert!(seen >= 10, "only {seen} constants compared");
}
