//! Naming a guest's function addresses: the function symbols of its ELF image (32-bit or
//! 64-bit), and the relocations that moved code after it was linked (a [`Reloc`] record from
//! the guest, or one the user names).
//!
//! An address is first moved back to where the linker put it (the newest relocation whose
//! run-time range holds it), then named by the function symbol whose range holds that link
//! address. Symbols without a size reach up to the next symbol.

use std::path::Path;

use object::read::elf::{ElfFile, ElfFile32, ElfFile64, FileHeader};
use object::{Endianness, FileKind, Object, ObjectSymbol, SymbolKind};

use crate::guestmem::elf::{ElfError, read_image};

/// The most relocations one recording keeps; later ones are counted and ignored (a guest
/// cannot make the host's memory grow).
pub const MAX_RELOCS: usize = 64;

/// Code linked at `[link, link + len)` that runs at `[runtime, runtime + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reloc {
    /// Where the linker put the code.
    pub link: u64,
    /// Where it runs.
    pub runtime: u64,
    /// Its length in bytes.
    pub len: u64,
}

impl Reloc {
    /// `addr` moved back to its link address, if this relocation's run-time range holds it.
    #[must_use]
    pub fn undo(&self, addr: u64) -> Option<u64> {
        let off = addr.checked_sub(self.runtime)?;
        (off < self.len).then(|| self.link.wrapping_add(off))
    }
}

impl std::fmt::Display for Reloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:#x}..{:#x} runs at {:#x}..{:#x}",
            self.link,
            self.link.wrapping_add(self.len),
            self.runtime,
            self.runtime.wrapping_add(self.len)
        )
    }
}

/// Parses the `--reloc LINK:RUNTIME:LEN` argument (each number decimal or `0x` hex).
///
/// # Errors
/// A message saying what is wrong.
pub fn parse_reloc(s: &str) -> Result<Reloc, String> {
    let num = |t: &str| {
        let t = t.trim();
        let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
            Some(h) => u64::from_str_radix(h, 16),
            None => t.parse(),
        };
        r.map_err(|e| format!("{t:?}: {e}"))
    };
    let parts: Vec<&str> = s.split(':').collect();
    let [link, runtime, len] = parts[..] else {
        return Err(format!(
            "{s:?}: expected LINK:RUNTIME:LEN (e.g. 0xf0000:0x7fbd000:0x1a2b0)"
        ));
    };
    Ok(Reloc {
        link: num(link)?,
        runtime: num(runtime)?,
        len: num(len)?,
    })
}

/// One function symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sym {
    addr: u64,
    /// 0: unknown (reaches up to the next symbol).
    size: u64,
    name: String,
}

/// An image's function symbols, sorted by address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Symbols {
    syms: Vec<Sym>,
}

impl Symbols {
    /// The function symbols of the ELF image at `path`.
    ///
    /// # Errors
    /// [`ElfError`]: unreadable, too large or not ELF.
    pub fn from_elf_file(path: &Path) -> Result<Self, ElfError> {
        Self::from_elf(&read_image(path)?)
    }

    /// The function symbols of the ELF image `bytes` (32-bit or 64-bit).
    ///
    /// # Errors
    /// [`ElfError`]: not ELF.
    pub fn from_elf(bytes: &[u8]) -> Result<Self, ElfError> {
        let mut syms = match FileKind::parse(bytes)? {
            FileKind::Elf32 => functions(&ElfFile32::<Endianness>::parse(bytes)?),
            FileKind::Elf64 => functions(&ElfFile64::<Endianness>::parse(bytes)?),
            other => return Err(ElfError::NotElf(other)),
        };
        syms.sort_by(|a, b| a.addr.cmp(&b.addr).then(b.size.cmp(&a.size)));
        // One name per address: the first (largest) of aliases.
        syms.dedup_by_key(|s| s.addr);
        Ok(Self { syms })
    }

    /// Symbols from (address, size, name) triples (for tests and callers that name code
    /// without an image).
    #[must_use]
    pub fn from_pairs(pairs: &[(u64, u64, &str)]) -> Self {
        let mut syms: Vec<Sym> = pairs
            .iter()
            .map(|&(addr, size, name)| Sym {
                addr,
                size,
                name: name.to_owned(),
            })
            .collect();
        syms.sort_by(|a, b| a.addr.cmp(&b.addr).then(b.size.cmp(&a.size)));
        syms.dedup_by_key(|s| s.addr);
        Self { syms }
    }

    /// How many function symbols.
    #[must_use]
    pub fn len(&self) -> usize {
        self.syms.len()
    }

    /// No function symbols (a stripped image).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.syms.is_empty()
    }

    /// The symbol whose range holds the link address `addr`, and `addr`'s offset into it.
    #[must_use]
    pub fn lookup(&self, addr: u64) -> Option<(&str, u64)> {
        let i = self
            .syms
            .partition_point(|s| s.addr <= addr)
            .checked_sub(1)?;
        let s = &self.syms[i];
        let off = addr - s.addr;
        let end = if s.size > 0 {
            s.addr.saturating_add(s.size)
        } else {
            self.syms.get(i + 1).map_or(u64::MAX, |n| n.addr)
        };
        (addr < end).then_some((s.name.as_str(), off))
    }

    /// Every function symbol as (link address, name), by address.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &str)> {
        self.syms.iter().map(|s| (s.addr, s.name.as_str()))
    }
}

/// The defined function symbols of one ELF class.
fn functions<Elf: FileHeader<Endian = Endianness>>(elf: &ElfFile<'_, Elf>) -> Vec<Sym> {
    elf.symbols()
        .filter(|s| s.kind() == SymbolKind::Text && s.is_definition())
        .filter_map(|s| {
            let name = s.name().ok()?;
            (!name.is_empty()).then(|| Sym {
                addr: s.address(),
                size: s.size(),
                name: name.to_owned(),
            })
        })
        .collect()
}

/// Names run-time function addresses: relocations undone, then symbols.
#[derive(Clone, Debug, Default)]
pub struct Namer {
    symbols: Option<std::sync::Arc<Symbols>>,
    relocs: Vec<Reloc>,
    /// How many of `relocs` the user named (they come first and stay across boots).
    named: usize,
    /// Relocations refused beyond [`MAX_RELOCS`].
    pub dropped_relocs: u64,
}

impl Namer {
    /// A namer with these symbols (none: every address is named in hex) and relocations.
    #[must_use]
    pub fn new(symbols: Option<std::sync::Arc<Symbols>>, relocs: &[Reloc]) -> Self {
        let mut n = Self {
            symbols,
            ..Self::default()
        };
        for r in relocs {
            n.add_reloc(*r);
        }
        n.named = n.relocs.len();
        n
    }

    /// Adds a relocation the guest recorded.
    pub fn add_guest_reloc(&mut self, r: Reloc) {
        self.add_reloc(r);
    }

    /// Forgets the guest's relocations (a new boot), keeping the user's.
    pub fn forget_guest_relocs(&mut self) {
        self.relocs.truncate(self.named);
    }

    /// Adds a relocation; it takes precedence over earlier ones that overlap it.
    pub fn add_reloc(&mut self, r: Reloc) {
        if self.relocs.len() < MAX_RELOCS {
            self.relocs.push(r);
        } else {
            self.dropped_relocs += 1;
        }
    }

    /// The relocations in force, oldest first.
    #[must_use]
    pub fn relocs(&self) -> &[Reloc] {
        &self.relocs
    }

    /// The symbols, if any.
    #[must_use]
    pub fn symbols(&self) -> Option<&Symbols> {
        self.symbols.as_deref()
    }

    /// `addr` moved back to its link address (unchanged when no relocation holds it).
    #[must_use]
    pub fn link_address(&self, addr: u64) -> u64 {
        self.relocs
            .iter()
            .rev()
            .find_map(|r| r.undo(addr))
            .unwrap_or(addr)
    }

    /// The name of the function at run-time address `addr` and the address the name stands
    /// for: `(symbol, link address)` when a symbol holds it (`symbol+0x10` when `addr` is not
    /// the symbol's start), else `("0x…", addr)`.
    #[must_use]
    pub fn name(&self, addr: u64) -> (String, u64) {
        let link = self.link_address(addr);
        match self.symbols.as_deref().and_then(|s| s.lookup(link)) {
            Some((name, 0)) => (name.to_owned(), link),
            Some((name, off)) => (format!("{name}+{off:#x}"), link),
            None => (format!("{addr:#x}"), addr),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::sync::Arc;

    use super::{Namer, Reloc, Symbols, parse_reloc};

    /// A real image per class, linked by gcc: the names `nm` sees come back, and an address
    /// inside a function is named by it.
    #[test]
    fn names_come_from_a_real_image_of_each_class() {
        let (dir, src) = crate::testutil::temp_file(
            "vmtsync-symbols-",
            "f.c",
            "int alpha(int x) { return x * 3 + 1; }\n\
             int beta(int x) { return alpha(x) + alpha(x + 1); }\n\
             void _start(void) { for (;;) beta(2); }\n",
        );
        for m in ["-m32", "-m64"] {
            let out = dir.path().join(format!("f{m}.elf"));
            let st = Command::new("gcc")
                .args([
                    m,
                    "-O1",
                    "-nostdlib",
                    "-static",
                    "-fno-pie",
                    "-no-pie",
                    "-o",
                ])
                .arg(&out)
                .arg(&src)
                .status();
            let Ok(st) = st else {
                assert!(std::env::var_os("CI").is_none(), "gcc is a CI prerequisite");
                eprintln!("skipped: no gcc");
                return;
            };
            if !st.success() {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "gcc {m} failed (gcc-multilib is a CI prerequisite)"
                );
                eprintln!("skipped {m}: gcc cannot link this class here");
                continue;
            }
            let nm = Command::new("nm").arg(&out).output().unwrap();
            let nm = String::from_utf8(nm.stdout).unwrap();
            let addr_of = |name: &str| {
                let line = nm
                    .lines()
                    .find(|l| l.ends_with(&format!(" {name}")))
                    .unwrap();
                u64::from_str_radix(line.split(' ').next().unwrap(), 16).unwrap()
            };
            let syms = Symbols::from_elf_file(&out).unwrap();
            for name in ["alpha", "beta", "_start"] {
                assert_eq!(syms.lookup(addr_of(name)), Some((name, 0)), "{m} {name}");
            }
            let namer = Namer::new(Some(Arc::new(syms)), &[]);
            let (n, link) = namer.name(addr_of("beta") + 1);
            assert_eq!((n.as_str(), link), ("beta+0x1", addr_of("beta") + 1), "{m}");
        }
    }

    #[test]
    fn relocations_are_undone_newest_first() {
        let syms = Symbols {
            syms: vec![
                super::Sym {
                    addr: 0x1000,
                    size: 0x10,
                    name: "f".into(),
                },
                super::Sym {
                    addr: 0x1010,
                    size: 0,
                    name: "g".into(),
                },
            ],
        };
        let mut n = Namer::new(Some(Arc::new(syms)), &[]);
        assert_eq!(n.name(0x1004), ("f+0x4".to_owned(), 0x1004));
        assert_eq!(
            n.name(0x9000).0,
            "g+0x7ff0",
            "sizeless: up to the next symbol"
        );
        assert_eq!(
            n.name(0x500),
            ("0x500".to_owned(), 0x500),
            "below every symbol"
        );
        n.add_reloc(Reloc {
            link: 0x1000,
            runtime: 0x7000,
            len: 0x20,
        });
        assert_eq!(n.name(0x7000), ("f".to_owned(), 0x1000));
        assert_eq!(n.name(0x7010), ("g".to_owned(), 0x1010));
        assert_eq!(
            n.name(0x7020),
            ("g+0x6010".to_owned(), 0x7020),
            "past the range"
        );
        n.add_reloc(Reloc {
            link: 0x1010,
            runtime: 0x7000,
            len: 0x10,
        });
        assert_eq!(n.name(0x7000).0, "g", "the newest relocation wins");
    }

    #[test]
    fn the_reloc_argument_parses() {
        assert_eq!(
            parse_reloc("0xf0000:0x7fbd000:4096"),
            Ok(Reloc {
                link: 0xf0000,
                runtime: 0x7fb_d000,
                len: 4096
            })
        );
        assert!(parse_reloc("1:2").is_err());
        assert!(parse_reloc("1:x:3").is_err());
    }
}
