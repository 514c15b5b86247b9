//! The crate's files import downward only, never in a circle: a file that imports
//! another, however far down, is never imported back by it. This test reads every
//! `.rs` file under `rust/src` and fails naming a circle in each tangle it finds.
//!
//! An edge is a path one file names into another: a `use` of `crate::…`, `super::…`,
//! `self::…` or of a child module (`use access::JobCheck` in `lighthouse/mod.rs`), and
//! a `crate::…`, `super::…` or `self::…` path in the code. A path leads to the file
//! that defines the longest module it names (`crate::lighthouse::jobs::JobName`:
//! `lighthouse/jobs.rs`; `crate::Error`: `lib.rs`). Not edges: a `mod child;`
//! declaration, a parent's call into its child by the name it declared
//! (`wire::serve(…)` in `lighthouse/mod.rs`, without a `use`), comments and strings,
//! and the code of an inline `#[cfg(test)]` module, which sits above everything it
//! tests (a file of tests, `state/tests.rs`, is a file like any other, that nothing
//! imports). `rust/src/bin/` is left out: each file there is a crate of its own.
//!
//! The parser is a plain tokenizer, not Rust's grammar: enough for the code we write
//! (no `#[path]`), checked on small sources below.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs;
use std::path::Path;

/// A file's module path: `lighthouse/site.rs` and `lighthouse/site/mod.rs` are
/// `["lighthouse", "site"]`, `lib.rs` is `[]`.
fn module_of(file: &str) -> Vec<String> {
    let mut segments: Vec<String> = file
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_string)
        .collect();
    if matches!(segments.last().map(String::as_str), Some("mod" | "lib")) {
        segments.pop();
    }
    segments
}

/// `text` with its comments and its string and character literals blanked out, every
/// newline kept, so that lines still count.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        // A line comment, doc comments included.
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        // A block comment, nested ones included.
        if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            continue;
        }
        // A raw string: r"…", r#"…"#, br#"…"# (the b is an identifier's end here).
        let starts_ident = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if c == 'r' && (next == Some('"') || next == Some('#')) && {
            let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
            chars.get(i + 1 + hashes) == Some(&'"')
                && (starts_ident || (i > 0 && chars[i - 1] == 'b'))
        } {
            let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
            i += 2 + hashes;
            while i < chars.len() {
                let closes = chars[i] == '"'
                    && chars
                        .get(i + 1..i + 1 + hashes)
                        .is_some_and(|h| h.iter().all(|&c| c == '#'));
                if closes {
                    i += 1 + hashes;
                    break;
                }
                blank(&mut out, chars[i]);
                i += 1;
            }
            continue;
        }
        if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if let Some(&c) = chars.get(i) {
                    blank(&mut out, c);
                }
                i += 1;
            }
            i += 1;
            continue;
        }
        // A character literal ('x', '\n', '\''); else a lifetime or a label ('a).
        if c == '\'' {
            if next == Some('\\') {
                i += 3;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                continue;
            }
            if chars.get(i + 2) == Some(&'\'') {
                i += 3;
                continue;
            }
        }
        out.push(c);
        i += 1;
    }
    out
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    /// `::`, or any other single character that is not white space.
    Punct(&'static str),
    Other,
}

/// The tokens of code (see `code_only`), each with its line.
fn tokens(code: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push((Token::Ident(chars[start..i].iter().collect()), line));
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push((Token::Punct("::"), line));
            i += 2;
        } else {
            let punct = match c {
                '{' => Token::Punct("{"),
                '}' => Token::Punct("}"),
                ';' => Token::Punct(";"),
                ',' => Token::Punct(","),
                '*' => Token::Punct("*"),
                '#' => Token::Punct("#"),
                '[' => Token::Punct("["),
                ']' => Token::Punct("]"),
                '(' => Token::Punct("("),
                ')' => Token::Punct(")"),
                _ => Token::Other,
            };
            out.push((punct, line));
            i += 1;
        }
    }
    out
}

fn ident(token: Option<&(Token, usize)>) -> Option<&str> {
    match token {
        Some((Token::Ident(name), _)) => Some(name),
        _ => None,
    }
}

fn is(token: Option<&(Token, usize)>, punct: &str) -> bool {
    matches!(token, Some((Token::Punct(p), _)) if *p == punct)
}

/// The paths of one use tree, from `tokens[*at]` (after `use`) to its end: `a::{b,
/// c::{self, D}}` is `a::b`, `a::c` and `a::c::D`; a glob stops at its module.
fn use_tree(tokens: &[(Token, usize)], at: &mut usize, prefix: &[String]) -> Vec<Vec<String>> {
    let mut path = prefix.to_vec();
    if is(tokens.get(*at), "::") {
        *at += 1;
    }
    loop {
        if let Some(name) = ident(tokens.get(*at)) {
            *at += 1;
            if name != "self" || path.is_empty() {
                path.push(name.to_string());
            }
            if is(tokens.get(*at), "::") {
                *at += 1;
                continue;
            }
            if ident(tokens.get(*at)) == Some("as") {
                *at += 2;
            }
            return vec![path];
        }
        if is(tokens.get(*at), "*") {
            *at += 1;
            return vec![path];
        }
        if is(tokens.get(*at), "{") {
            *at += 1;
            let mut paths = Vec::new();
            while *at < tokens.len() && !is(tokens.get(*at), "}") {
                if is(tokens.get(*at), ",") {
                    *at += 1;
                    continue;
                }
                let before = *at;
                paths.extend(use_tree(tokens, at, &path));
                if *at == before {
                    *at += 1;
                }
            }
            *at += 1;
            return paths;
        }
        return vec![path];
    }
}

/// A path that one file names, in the module it names it from.
#[derive(Debug)]
struct Named {
    line: usize,
    /// The module the path is written in: the file's, or an inline one in it.
    from: Vec<String>,
    path: Vec<String>,
    in_use: bool,
}

/// Every path a file of module `module` names outside its inline test modules.
fn named_paths(text: &str, module: &[String]) -> Vec<Named> {
    let tokens = tokens(&code_only(text));
    let mut named = Vec::new();
    // The inline modules the walk is in: name, the depth of braces inside it, test.
    let mut scopes: Vec<(String, usize, bool)> = Vec::new();
    let mut depth = 0;
    let mut test_attribute = false;
    let mut at = 0;
    while at < tokens.len() {
        let in_test = scopes.last().is_some_and(|s| s.2);
        let from = || {
            let mut from = module.to_vec();
            from.extend(scopes.iter().map(|s| s.0.clone()));
            from
        };
        let (token, line) = &tokens[at];
        match token {
            Token::Punct("#") if tokens[at + 1..].len() >= 6 => {
                let attribute: Vec<&Token> = tokens[at + 1..at + 7].iter().map(|t| &t.0).collect();
                let cfg_test = [
                    Token::Punct("["),
                    Token::Ident("cfg".into()),
                    Token::Punct("("),
                    Token::Ident("test".into()),
                    Token::Punct(")"),
                    Token::Punct("]"),
                ];
                if attribute.iter().zip(cfg_test.iter()).all(|(a, b)| *a == b) {
                    test_attribute = true;
                    at += 7;
                    continue;
                }
            }
            Token::Punct("{") => {
                depth += 1;
                test_attribute = false;
            }
            Token::Punct("}") => {
                if scopes.last().is_some_and(|s| s.1 == depth) {
                    scopes.pop();
                }
                depth -= 1;
                test_attribute = false;
            }
            Token::Punct(";") => test_attribute = false,
            Token::Ident(word) if word == "mod" => {
                if let (Some(name), true) = (ident(tokens.get(at + 1)), is(tokens.get(at + 2), "{"))
                {
                    depth += 1;
                    scopes.push((name.to_string(), depth, in_test || test_attribute));
                    test_attribute = false;
                    at += 3;
                    continue;
                }
            }
            Token::Ident(word) if word == "use" => {
                at += 1;
                let paths = use_tree(&tokens, &mut at, &[]);
                if !in_test {
                    for path in paths {
                        named.push(Named {
                            line: *line,
                            from: from(),
                            path,
                            in_use: true,
                        });
                    }
                }
                continue;
            }
            Token::Ident(word)
                if matches!(word.as_str(), "crate" | "super" | "self")
                    && is(tokens.get(at + 1), "::")
                    && !(at > 0 && is(tokens.get(at - 1), "::"))
                    && !(at >= 3
                        && ident(tokens.get(at - 1)) == Some("in")
                        && ident(tokens.get(at - 3)) == Some("pub")) =>
            {
                let mut path = vec![word.clone()];
                at += 1;
                while is(tokens.get(at), "::") {
                    match ident(tokens.get(at + 1)) {
                        Some(segment) => path.push(segment.to_string()),
                        None => break,
                    }
                    at += 2;
                }
                if !in_test {
                    named.push(Named {
                        line: *line,
                        from: from(),
                        path,
                        in_use: false,
                    });
                }
                continue;
            }
            _ => {}
        }
        at += 1;
    }
    named
}

/// The module a path leads to, if it is one of the crate's (`modules`); None for a
/// path into another crate (`std::…`, `tonic::…`).
fn resolve(named: &Named, modules: &BTreeMap<Vec<String>, String>) -> Option<Vec<String>> {
    let mut segments = named.path.iter().peekable();
    let mut base = match segments.peek().map(|s| s.as_str()) {
        Some("crate") => {
            segments.next();
            Vec::new()
        }
        Some("super") | Some("self") => {
            let mut base = named.from.clone();
            while let Some(word) = segments.peek().map(|s| s.as_str()) {
                match word {
                    "super" => {
                        base.pop()?;
                    }
                    "self" => {}
                    _ => break,
                }
                segments.next();
            }
            base
        }
        Some(first) if named.in_use => {
            let mut child = named.from.clone();
            child.push(first.to_string());
            if !modules.contains_key(&child) {
                return None;
            }
            named.from.clone()
        }
        _ => return None,
    };
    base.extend(segments.cloned());
    // The longest module the path names: the rest are items in it.
    (0..=base.len())
        .rev()
        .map(|k| base[..k].to_vec())
        .find(|prefix| modules.contains_key(prefix))
}

/// File to file: each file the key names, with the line of the first such path.
type Graph = BTreeMap<String, BTreeMap<String, usize>>;

/// The import graph of a crate's `files` (path under `rust/src`, text).
fn graph(files: &[(String, String)]) -> Graph {
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|(file, _)| (module_of(file), file.clone()))
        .collect();
    let mut graph = Graph::new();
    for (file, text) in files {
        let edges = graph.entry(file.clone()).or_default();
        for named in named_paths(text, &module_of(file)) {
            let Some(target) = resolve(&named, &modules) else {
                continue;
            };
            let target = &modules[&target];
            if target != file {
                edges.entry(target.clone()).or_insert(named.line);
            }
        }
    }
    graph
}

/// Files that import each other: a shortest circle among them, and all of them.
struct Circle {
    /// The files in order, the first again at the end, each with the line that
    /// imports the next (0 at the end).
    path: Vec<(String, usize)>,
    /// Every file of the tangle the circle is one of, each reached from each.
    tangle: Vec<String>,
}

/// One circle in each tangle of files that import each other.
fn circles(graph: &Graph) -> Vec<Circle> {
    // Tarjan's strongly connected components, then a shortest circle in each.
    struct Walk<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(walk: &mut Walk<'a>, file: &'a str) {
        let n = walk.index.len();
        walk.index.insert(file, n);
        walk.low.insert(file, n);
        walk.stack.push(file);
        walk.on_stack.insert(file);
        let graph = walk.graph;
        for next in graph.get(file).into_iter().flat_map(|e| e.keys()) {
            let next = next.as_str();
            if !walk.index.contains_key(next) {
                visit(walk, next);
                let low = walk.low[file].min(walk.low[next]);
                walk.low.insert(file, low);
            } else if walk.on_stack.contains(next) {
                let low = walk.low[file].min(walk.index[next]);
                walk.low.insert(file, low);
            }
        }
        if walk.low[file] == walk.index[file] {
            let mut component = Vec::new();
            while let Some(top) = walk.stack.pop() {
                walk.on_stack.remove(top);
                component.push(top);
                if top == file {
                    break;
                }
            }
            walk.components.push(component);
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for file in graph.keys() {
        if !walk.index.contains_key(file.as_str()) {
            visit(&mut walk, file);
        }
    }
    let mut circles = Vec::new();
    for component in walk.components.iter().filter(|c| c.len() > 1) {
        let inside: BTreeSet<&str> = component.iter().copied().collect();
        let start = *inside.iter().next().expect("a component has files");
        // Breadth first from `start` back to it, inside the component.
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = VecDeque::from([start]);
        let mut last = None;
        'search: while let Some(file) = queue.pop_front() {
            for next in graph[file].keys().map(String::as_str) {
                if next == start {
                    last = Some(file);
                    break 'search;
                }
                if inside.contains(next) && !came_from.contains_key(next) {
                    came_from.insert(next, file);
                    queue.push_back(next);
                }
            }
        }
        // Back from the file that imports `start`, then in order.
        let mut back = Vec::new();
        let mut file = last.expect("a component of several files holds a circle");
        while file != start {
            back.push(file);
            file = came_from[file];
        }
        let order: Vec<&str> = std::iter::once(start)
            .chain(back.into_iter().rev())
            .chain(std::iter::once(start))
            .collect();
        let path = order
            .windows(2)
            .map(|pair| (pair[0].to_string(), graph[pair[0]][pair[1]]))
            .chain(std::iter::once((start.to_string(), 0)))
            .collect();
        let tangle = inside.iter().map(|file| file.to_string()).collect();
        circles.push(Circle { path, tangle });
    }
    circles
}

fn describe(circle: &Circle) -> String {
    let path = circle
        .path
        .iter()
        .map(|(file, line)| match line {
            0 => file.clone(),
            line => format!("{file}:{line}"),
        })
        .collect::<Vec<_>>()
        .join(" → ");
    if circle.tangle.len() < circle.path.len() {
        return path;
    }
    format!(
        "{path}\n    (one circle among {} files that reach each other: {})",
        circle.tangle.len(),
        circle.tangle.join(", ")
    )
}

/// Every `.rs` file under `dir`, as its path under `root`, with its text.
fn read_sources(root: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path
            .strip_prefix(root)
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/");
        if path.is_dir() {
            if name != "bin" {
                read_sources(root, &path, files);
            }
        } else if name.ends_with(".rs") {
            let text = fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            files.push((name, text));
        }
    }
}

#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("rust/src");
    let mut files = Vec::new();
    read_sources(&root, &root, &mut files);
    let graph = graph(&files);
    let edges: usize = graph.values().map(BTreeMap::len).sum();
    // A parser that reads nothing finds no circle either.
    assert!(
        files.len() > 40 && edges > 2 * files.len(),
        "only {edges} imports among {} files under {}: the parser misreads them",
        files.len(),
        root.display()
    );
    let circles: Vec<String> = circles(&graph).iter().map(describe).collect();
    assert!(
        circles.is_empty(),
        "files that import each other, each at the line that imports the next (a \
         layer imports downward only: move what both need below both):\n  {}",
        circles.join("\n  ")
    );
}

fn crate_of(files: &[(&str, &str)]) -> Graph {
    let files: Vec<(String, String)> = files
        .iter()
        .map(|(file, text)| (file.to_string(), text.to_string()))
        .collect();
    graph(&files)
}

fn targets(graph: &Graph, file: &str) -> Vec<String> {
    graph[file].keys().cloned().collect()
}

#[test]
fn uses_and_paths_lead_to_the_files_that_define_their_modules() {
    let graph = crate_of(&[
        ("lib.rs", "mod a;\nmod b;\npub use a::Thing;\n"),
        ("a/mod.rs", "pub mod c;\nuse c::Deep;\npub struct Thing;\n"),
        ("a/c.rs", "use super::super::b::{self, Other as O};\n"),
        (
            "b.rs",
            "use std::io;\nuse tonic::{Request,\n    Status};\n\
             fn f() { let _ = crate::a::c::Deep::new(); }\n",
        ),
    ]);
    assert_eq!(targets(&graph, "lib.rs"), ["a/mod.rs"]);
    assert_eq!(targets(&graph, "a/mod.rs"), ["a/c.rs"]);
    assert_eq!(targets(&graph, "a/c.rs"), ["b.rs"]);
    assert_eq!(targets(&graph, "b.rs"), ["a/c.rs"]);
    assert_eq!(graph["b.rs"]["a/c.rs"], 4);
    let circles = circles(&graph);
    assert_eq!(circles.len(), 1);
    assert_eq!(describe(&circles[0]), "a/c.rs:1 → b.rs:4 → a/c.rs");
}

#[test]
fn declarations_comments_strings_and_inline_tests_are_no_imports() {
    let graph = crate_of(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
        (
            "a.rs",
            "//! See `crate::b`.\nmod inner;\npub(crate) fn f() -> &'static str {\n    \
             \"crate::b::g\" /* crate::b */\n}\nconst C: char = '\"';\n\
             const R: &str = r#\"crate::b::\"#;\n",
        ),
        (
            "a/inner.rs",
            "pub(super) fn g() {}\npub(in crate::a) fn h() {}\n",
        ),
        ("c.rs", "pub const ALL: [u8; 0] = [];\n"),
        (
            "b.rs",
            "use crate::a;\n#[cfg(test)]\nmod tests {\n    use crate::a::inner;\n    \
             mod deeper { fn h() { super::super::x(); } }\n}\n\
             fn after() { for _ in crate::c::ALL {} }\n",
        ),
    ]);
    assert!(targets(&graph, "lib.rs").is_empty());
    assert!(targets(&graph, "a.rs").is_empty());
    assert!(targets(&graph, "a/inner.rs").is_empty());
    assert_eq!(targets(&graph, "b.rs"), ["a.rs", "c.rs"]);
    assert!(circles(&graph).is_empty());
}

#[test]
fn a_child_that_imports_its_parent_closes_a_circle_only_with_a_use_back() {
    let child = ("p/child.rs", "use super::Shared;\n");
    let declared = crate_of(&[
        ("lib.rs", "mod p;\n"),
        ("p/mod.rs", "mod child;\npub struct Shared;\n"),
        child,
    ]);
    assert!(circles(&declared).is_empty());
    let imported = crate_of(&[
        ("lib.rs", "mod p;\n"),
        (
            "p/mod.rs",
            "mod child;\npub use child::Open;\npub struct Shared;\n",
        ),
        child,
    ]);
    let circles = circles(&imported);
    assert_eq!(
        describe(&circles[0]),
        "p/child.rs:1 → p/mod.rs:2 → p/child.rs"
    );
}
