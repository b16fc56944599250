//! `vmtsync spans` through the real CLI: a recording whose span records name functions of a
//! real 32-bit image (linked by gcc, addresses read back with `nm`), one call made through
//! relocated code, one exit whose entry is missing and a call that never returns.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::util::{guarded_output, jsonl_line, read_jsonl, scratch, vmtsync};

/// The image's symbol addresses as `nm` prints them.
fn nm(image: &Path, name: &str) -> u64 {
    let o = Command::new("nm").arg(image).output().expect("nm runs");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = text
        .lines()
        .find(|l| l.ends_with(&format!(" {name}")))
        .unwrap_or_else(|| panic!("nm lists no {name}:\n{text}"));
    u64::from_str_radix(line.split(' ').next().unwrap(), 16).unwrap()
}

fn func(id: u64, f: u64, t: u64) -> String {
    let mut p = u32::try_from(f).unwrap().to_le_bytes().to_vec();
    p.extend_from_slice(&0x1234u32.to_le_bytes());
    jsonl_line(0, id, t, t, t - 5, t + 5, &p)
}

#[test]
fn spans_are_named_paired_and_the_unfinished_ones_marked() {
    let dir = scratch("spans_cli");
    let src = dir.path().join("f.c");
    std::fs::write(
        &src,
        "int alpha(int x) { return x * 3 + 1; }\n\
         int beta(int x) { return alpha(x) + alpha(x + 1); }\n\
         void _start(void) { for (;;) beta(2); }\n",
    )
    .unwrap();
    let image = dir.path().join("f.elf");
    let built = Command::new("gcc")
        .args([
            "-m32",
            "-O1",
            "-nostdlib",
            "-static",
            "-fno-pie",
            "-no-pie",
            "-o",
        ])
        .arg(&image)
        .arg(&src)
        .status()
        .expect("gcc runs (a CI prerequisite)");
    assert!(
        built.success(),
        "gcc -m32 links (gcc-multilib is a CI prerequisite)"
    );
    let (alpha, beta, start) = (
        nm(&image, "alpha"),
        nm(&image, "beta"),
        nm(&image, "_start"),
    );
    // beta's code moved to 0x800000 by the guest's relocation record.
    let mut reloc = beta.to_le_bytes()[..6].to_vec();
    reloc.extend_from_slice(&0x80_0000u64.to_le_bytes()[..6]);
    reloc.extend_from_slice(&0x10u32.to_le_bytes());
    let lines = [
        jsonl_line(0, 0xFF01, 1000, 1000, 990, 1010, b"post"),
        func(0xFF04, alpha, 1100), // an exit whose entry the ring lost
        func(0xFF03, beta, 2000),
        func(0xFF03, alpha, 2100),
        func(0xFF04, alpha, 2600),
        func(0xFF04, beta, 3000),
        jsonl_line(0, 0xFF05, 3100, 3100, 3095, 3105, &reloc),
        func(0xFF03, 0x80_0000, 4000),
        func(0xFF04, 0x80_0000, 4500),
        func(0xFF03, start, 5000), // never returns
        jsonl_line(0, 7, 5100, 5100, 5095, 5105, b"x"),
    ];
    let rec = dir.path().join("rec.jsonl");
    std::fs::write(&rec, lines.join("\n") + "\n").unwrap();
    let out = dir.path().join("spans.jsonl");
    let svg = dir.path().join("spans.svg");
    let o = guarded_output(
        vmtsync()
            .args(["spans", "--from"])
            .arg(&rec)
            .arg("--symbols")
            .arg(&image)
            .args(["--tsc-hz", "1000000000", "--out", out.to_str().unwrap()])
            .arg("--svg")
            .arg(&svg),
        b"",
    );
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        text.contains("spans: 3 closed (0 phases, 3 functions), 2 open at the end, 0 abandoned (exit never seen), 1 exits without their entry; 1 other events"),
        "{text}"
    );
    assert!(
        text.contains(&format!("relocation: code linked at {beta:#x}..")),
        "{text}"
    );
    assert!(text.contains("_start  (open: exit not seen)"), "{text}");
    assert!(text.contains("alpha  (exit; entry not seen)"), "{text}");
    // The longest: beta, 1000 ns, guaranteed within 990..1010 ns.
    assert!(
        text.contains("1.000 µs (guaranteed 0.990 .. 1.010 µs)"),
        "{text}"
    );
    let spans = read_jsonl(&out);
    let row = |s: &Value| {
        (
            s["name"].as_str().unwrap().to_owned(),
            s["depth"].as_u64().unwrap(),
            s["state"].as_str().unwrap().to_owned(),
        )
    };
    let rows: Vec<_> = spans.iter().map(row).collect();
    let r = |n: &str, d, st: &str| (n.to_owned(), d, st.to_owned());
    assert_eq!(
        rows,
        [
            r("alpha", 0, "orphan"),
            r("alpha", 1, "closed"),
            r("beta", 0, "closed"),
            r("beta", 0, "closed"),
            r("post", 0, "open"),
            r("_start", 0, "open"),
        ]
    );
    assert_eq!(
        spans[3]["addr"].as_u64(),
        Some(beta),
        "the link address, relocation undone"
    );
    assert_eq!(spans[1]["begin"]["lo"].as_u64(), Some(2095));
    assert!(spans[5]["end"].is_null());
    // The picture: valid SVG whose titles name every span drawn.
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the picture is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let titles: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("title"))
        .filter_map(|n| n.text())
        .collect();
    for name in ["beta", "alpha", "_start", "post"] {
        assert!(
            titles.iter().any(|t| t.contains(name)),
            "{name} in {titles:?}"
        );
    }
}

#[test]
fn an_image_that_is_not_elf_is_bad_input() {
    let dir = scratch("spans_cli_bad");
    let rec = dir.path().join("rec.jsonl");
    std::fs::write(&rec, jsonl_line(0, 0xFF01, 1, 1, 0, 2, b"post") + "\n").unwrap();
    let o = guarded_output(
        vmtsync()
            .args(["spans", "--from"])
            .arg(&rec)
            .arg("--symbols")
            .arg(&rec)
            .args(["--tsc-hz", "1000000000"]),
        b"",
    );
    assert_eq!(
        o.status.code(),
        Some(5),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("--symbols"));
}

/// The picture the README shows (drawn by `vmtsync spans --svg` from a real `demo --firmware`
/// run) is a valid SVG with spans and host exits in it, and the README links it.
#[test]
fn the_readme_picture_is_valid_svg() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.contains("](docs/seabios-boot.svg)"),
        "the README shows the picture"
    );
    let text = std::fs::read_to_string(root.join("docs/seabios-boot.svg")).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("well-formed XML");
    let svg = doc.root_element();
    assert_eq!(svg.tag_name().name(), "svg");
    assert!(svg.attribute("viewBox").is_some() || svg.attribute("width").is_some());
    let titles: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("title"))
        .filter_map(|n| n.text())
        .collect();
    for name in ["startBoot", "pci_setup", "platform"] {
        assert!(titles.iter().any(|t| t.contains(name)), "{name} is drawn");
    }
    assert!(doc.descendants().filter(|n| n.has_tag_name("rect")).count() > 100);
}
