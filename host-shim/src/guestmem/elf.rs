//! `--elf IMAGE SYMBOL`: the guest-physical address of the recorder's symbol.
//!
//! A symbol's value is a link-time virtual address. The guest-physical address is where the
//! loader put that byte: the `PT_LOAD` segment that contains the value, moved from its
//! `p_vaddr` to its `p_paddr` (a PVH kernel links both equal; a higher-half kernel does not).

use std::path::{Path, PathBuf};

use object::read::elf::{ElfFile64, ProgramHeader};
use object::{Endianness, Object, ObjectSymbol};
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
    /// Not a 64-bit ELF file.
    #[error("not a 64-bit ELF image: {0}")]
    Parse(#[from] object::Error),
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

/// `name`'s guest-physical address in the ELF image `bytes`.
///
/// # Errors
/// [`ElfError`]: not ELF64, no such symbol, or not in a loaded segment.
pub fn symbol_guest_physical(bytes: &[u8], name: &str) -> Result<u64, ElfError> {
    let elf = ElfFile64::<Endianness>::parse(bytes)?;
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
            let vaddr = p.p_vaddr(endian);
            let off = value.checked_sub(vaddr)?;
            (off < p.p_memsz(endian)).then(|| p.p_paddr(endian).checked_add(off))?
        })
        .ok_or(ElfError::NotLoaded {
            name: name.to_owned(),
            value,
        })
}

/// [`symbol_guest_physical`] of the image at `path`.
///
/// # Errors
/// [`ElfError`], also for a file that cannot be read or is too large.
pub fn symbol_guest_physical_in(path: &Path, name: &str) -> Result<u64, ElfError> {
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
    let bytes = std::fs::read(path).map_err(read)?;
    symbol_guest_physical(&bytes, name)
}
