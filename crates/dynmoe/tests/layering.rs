//! The library's modules import one way: each from those below it in the table of
//! layers in docs/ARCHITECTURE.md, never from one above. This reads every source file's
//! `crate::` paths (outside comments and unit tests) and checks them against that table,
//! so the document and the code cannot drift apart.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The layers, bottom first: the first cell of each row of the table between the
/// `<!-- layers -->` and `<!-- /layers -->` marks, a module name in backticks.
fn layers() -> Vec<String> {
    let doc = root().join("../../docs/ARCHITECTURE.md");
    let text = std::fs::read_to_string(&doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
    let start = text
        .find("<!-- layers -->")
        .expect("docs/ARCHITECTURE.md marks its layers");
    let end = text.find("<!-- /layers -->").expect("the layers' end mark");
    text[start..end]
        .lines()
        .filter_map(|l| {
            let cell = l.strip_prefix('|')?.split('|').next()?.trim();
            Some(cell.strip_prefix('`')?.strip_suffix('`')?.to_string())
        })
        .collect()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a source file: its unit tests (from `#[cfg(test)]` on, where this crate
/// keeps them) and its comments left out.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules `code` names through `crate::`, grouped imports included.
fn imported_modules(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The first segment of each item of the group, at brace depth one.
            let mut depth = 1;
            let mut item_start = true;
            let mut name = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 1 => item_start = true,
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
                if item_start && depth == 1 {
                    if c.is_alphanumeric() || c == '_' {
                        name.push(c);
                    } else if !name.is_empty() {
                        found.insert(std::mem::take(&mut name));
                        item_start = false;
                    }
                }
            }
            if !name.is_empty() {
                found.insert(name);
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            found.insert(name);
        }
    }
    found
}

#[test]
fn every_module_imports_only_from_layers_below_it() {
    let layers = layers();
    assert!(layers.len() > 5, "too few layers read: {layers:?}");
    let src = root().join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let rank = |m: &str| layers.iter().position(|l| l == m);
    let mut wrong = Vec::new();
    let mut unlisted = BTreeSet::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" {
            continue;
        }
        let Some(mine) = rank(&module) else {
            unlisted.insert(module);
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for used in imported_modules(&code(&text)) {
            match rank(&used) {
                Some(theirs) if theirs > mine => {
                    wrong.push(format!("{}: {module} imports {used}", rel.display()))
                }
                Some(_) => {}
                None => {
                    unlisted.insert(used);
                }
            }
        }
    }
    assert!(
        unlisted.is_empty(),
        "modules missing from the layers of docs/ARCHITECTURE.md: {unlisted:?}"
    );
    assert!(
        wrong.is_empty(),
        "imports from a layer above (docs/ARCHITECTURE.md):\n{}",
        wrong.join("\n")
    );
}

/// The check itself: an upward import is found in a group, after a comment, and in
/// code, and nothing is read from comments or unit tests.
#[test]
fn imports_are_read_from_code_and_groups_alone() {
    let text = "use crate::{codec::vq, store};\n// crate::serve in a comment\nlet x = crate::model::argmax(&l); // crate::eval\n#[cfg(test)]\nuse crate::runtime;";
    let found = imported_modules(&code(text));
    let want: BTreeSet<String> = ["codec", "model", "store"].map(String::from).into();
    assert_eq!(found, want);
}
