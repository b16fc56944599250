//! `--elf IMAGE --symbol NAME`: the guest-physical address of the recorder's symbol, in a
//! 32-bit or a 64-bit ELF image.
//!
//! A symbol's value is a link-time virtual address. The guest-physical address is where the
//! loader put that byte: the `PT_LOAD` segment that contains the value, moved from its
//! `p_vaddr` to its `p_paddr` (a PVH kernel links both equal; a higher-half kernel does not).

use std::path::{Path, PathBuf};

use object::read::elf::{ElfFile, ElfFile32, ElfFile64, FileHeader, ProgramHeader};
use object::{Endianness, FileKind, Object, ObjectSymbol};
use thiserror::Error;

/// Largest image read (guest kernels here are a few MiB).
const MAX_IMAGE_BYTES: u64 = 512 << 20;

/// Why a symbol gave no address.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ElfError {
    /// The image could not be read.
    #[error("read {path}: {source}")]
    Read {
        /// The image.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The image is larger than a guest kernel can be.
    #[error("{path} is over {MAX_IMAGE_BYTES} bytes")]
    TooLarge {
        /// The image.
        path: PathBuf,
    },
    /// Not an ELF file that parses.
    #[error("not an ELF image: {0}")]
    Parse(#[from] object::Error),
    /// A file of another kind (not ELF).
    #[error("not an ELF image (a {0:?} file)")]
    NotElf(FileKind),
    /// No such symbol.
    #[error("no symbol {0:?} in the image's symbol tables (is it stripped?)")]
    NoSymbol(String),
    /// The symbol lies in no loaded segment.
    #[error("symbol {name:?} at {value:#x} lies in no PT_LOAD segment")]
    NotLoaded {
        /// The symbol.
        name: String,
        /// Its value.
        value: u64,
    },
}

/// `name`'s guest-physical address in the ELF image `bytes`, 32-bit (SeaBIOS's `out/rom.o`,
/// coreboot's stages) or 64-bit.
///
/// # Errors
/// [`ElfError`]: not ELF, no such symbol, or not in a loaded segment.
pub fn symbol_guest_physical(bytes: &[u8], name: &str) -> Result<u64, ElfError> {
    symbol_and_pointer_width(bytes, name).map(|(gpa, _)| gpa)
}

/// [`symbol_guest_physical`], with the image's pointer size in bytes (4 or 8).
fn symbol_and_pointer_width(bytes: &[u8], name: &str) -> Result<(u64, u8), ElfError> {
    match FileKind::parse(bytes)? {
        FileKind::Elf32 => Ok((in_elf(&ElfFile32::<Endianness>::parse(bytes)?, name)?, 4)),
        FileKind::Elf64 => Ok((in_elf(&ElfFile64::<Endianness>::parse(bytes)?, name)?, 8)),
        other => Err(ElfError::NotElf(other)),
    }
}

/// [`symbol_guest_physical`] for one ELF class.
fn in_elf<Elf: FileHeader<Endian = Endianness>>(
    elf: &ElfFile<'_, Elf>,
    name: &str,
) -> Result<u64, ElfError> {
    let value = elf
        .symbols()
        .chain(elf.dynamic_symbols())
        .find(|s| s.name() == Ok(name))
        .map(|s| s.address())
        .ok_or_else(|| ElfError::NoSymbol(name.to_owned()))?;
    let endian = elf.endian();
    elf.elf_program_headers()
        .iter()
        .filter(|p| p.p_type(endian) == object::elf::PT_LOAD)
        .find_map(|p| {
            let vaddr: u64 = p.p_vaddr(endian).into();
            let memsz: u64 = p.p_memsz(endian).into();
            let paddr: u64 = p.p_paddr(endian).into();
            let off = value.checked_sub(vaddr)?;
            (off < memsz).then(|| paddr.checked_add(off))?
        })
        .ok_or(ElfError::NotLoaded {
            name: name.to_owned(),
            value,
        })
}

/// The guest-physical address of the pointer variable `name` in the image at `path`, and the
/// pointer's size (4 in a 32-bit image, 8 in a 64-bit one).
///
/// # Errors
/// As [`symbol_guest_physical_in`].
pub fn pointer_guest_physical_in(path: &Path, name: &str) -> Result<(u64, u8), ElfError> {
    symbol_and_pointer_width(&read_image(path)?, name)
}

/// [`symbol_guest_physical`] of the image at `path`.
///
/// # Errors
/// [`ElfError`], also for a file that cannot be read or is too large.
pub fn symbol_guest_physical_in(path: &Path, name: &str) -> Result<u64, ElfError> {
    symbol_guest_physical(&read_image(path)?, name)
}

/// The image at `path`, refused beyond [`MAX_IMAGE_BYTES`].
pub(crate) fn read_image(path: &Path) -> Result<Vec<u8>, ElfError> {
    let read = |source| ElfError::Read {
        path: path.to_owned(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read)?.len();
    if len > MAX_IMAGE_BYTES {
        return Err(ElfError::TooLarge {
            path: path.to_owned(),
        });
    }
    std::fs::read(path).map_err(read)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::{ElfError, symbol_guest_physical_in};

    /// A real 32-bit image, linked by gcc and ld for i386 with its load address moved from its
    /// link address (`AT`), and the symbol's physical address as `nm` and `readelf` see it.
    #[test]
    fn a_32_bit_image_maps_a_symbol_to_its_load_address() {
        let dir = tempfile::tempdir().expect("a scratch directory");
        let c = dir.path().join("fw.c");
        let lds = dir.path().join("fw.lds");
        let elf = dir.path().join("fw.elf");
        std::fs::write(
            &c,
            "unsigned char vmtsync_fw_block[128] __attribute__((aligned(64)));\n\
             void _start(void) { vmtsync_fw_block[0] = 1; for (;;) {} }\n",
        )
        .expect("write the source");
        // Linked at 0xc0100000, loaded at 0x100000: the answer must be the load address.
        std::fs::write(
            &lds,
            "SECTIONS { . = 0xc0100000; .text : AT(0x100000) { *(.text*) } \
             .bss : AT(0x100000 + SIZEOF(.text) + 0x40) { *(.bss*) *(COMMON) } }\n",
        )
        .expect("write the linker script");
        let out = Command::new("gcc")
            .args([
                "-m32",
                "-ffreestanding",
                "-fno-pic",
                "-no-pie",
                "-nostdlib",
                "-static",
            ])
            .arg("-T")
            .arg(&lds)
            .arg("-o")
            .arg(&elf)
            .arg(&c)
            .output();
        let out = match out {
            Ok(o) => o,
            Err(e) if std::env::var_os("CI").is_none_or(|v| v != "true") => {
                eprintln!("skipped: gcc does not run here ({e})");
                return;
            }
            Err(e) => panic!("gcc under CI=true: {e}"),
        };
        assert!(
            out.status.success(),
            "gcc -m32: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let gpa = symbol_guest_physical_in(&elf, "vmtsync_fw_block").expect("the symbol's GPA");
        // The truth from binutils: the symbol's link address and the segment's p_vaddr/p_paddr.
        let nm = Command::new("nm").arg(&elf).output().expect("nm runs");
        let link = String::from_utf8_lossy(&nm.stdout)
            .lines()
            .find(|l| l.ends_with(" vmtsync_fw_block"))
            .and_then(|l| u64::from_str_radix(l.split_whitespace().next()?, 16).ok())
            .expect("nm lists the symbol");
        let re = Command::new("readelf")
            .args(["-lW"])
            .arg(&elf)
            .output()
            .expect("readelf runs");
        let text = String::from_utf8_lossy(&re.stdout);
        let seg = text
            .lines()
            .filter(|l| l.trim_start().starts_with("LOAD"))
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
                let (v, p, mem) = (hex(f[2])?, hex(f[3])?, hex(f[5])?);
                (link >= v && link < v + mem).then_some(link - v + p)
            })
            .expect("readelf shows the segment holding the symbol");
        assert_eq!(gpa, seg);
        assert!(
            gpa < 0x20_0000,
            "{gpa:#x} is the load address, not the link address"
        );
        assert_eq!(
            super::pointer_guest_physical_in(&elf, "vmtsync_fw_block").expect("a symbol"),
            (gpa, 4),
            "a 32-bit image's pointers are 4 bytes"
        );
        let e = symbol_guest_physical_in(&elf, "absent").expect_err("no such symbol");
        assert!(matches!(e, ElfError::NoSymbol(_)), "{e}");
    }
}
