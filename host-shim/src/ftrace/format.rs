//! Event record layouts as the kernel describes them, and the `kvm:kvm_pio` record.
//!
//! Every ftrace event has a `format` description (in tracefs under
//! `events/<system>/<name>/format`, and copied verbatim into a trace.dat's event-format
//! section): its numeric id and, for each field, its byte offset, size and signedness inside
//! the record. Field layouts differ between kernels (the common header has grown fields
//! before), so records are decoded through the description of the kernel that wrote them,
//! never through offsets compiled in. The text's shape is in `docs/ftrace.md`.
//!
//! Records are little-endian: vmtsync targets x86_64 hosts, and a trace.dat's endianness byte
//! is checked by the trace.dat reader before any record reaches this module.

use thiserror::Error;

/// Why a format description or a record could not be used.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatError {
    /// A line that should describe something could not be read.
    #[error("event format line {line}: {reason}: {text:?}")]
    Line {
        /// The 1-based line number.
        line: usize,
        /// What was wrong.
        reason: &'static str,
        /// The line.
        text: String,
    },
    /// The description has no `name:` or `ID:` line.
    #[error("event format: no {0} line")]
    Missing(&'static str),
    /// A field the decoder needs is absent or has an unusable size.
    #[error("event {event}: field {field} {problem}")]
    Field {
        /// The event's name.
        event: String,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

/// One field of an event record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    /// The C name, without any array suffix (`comm` for `char comm[16]`).
    pub name: String,
    /// The declaration as written (`unsigned int port`, `__data_loc char[] name`).
    pub declaration: String,
    /// Byte offset inside the record (the record starts with `common_type`).
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
    /// Whether the kernel marks it signed.
    pub signed: bool,
}

impl Field {
    /// The field as an unsigned integer, zero-extended; `None` when the record is too short or
    /// the size is not 1, 2, 4 or 8 bytes.
    #[must_use]
    pub fn unsigned(&self, record: &[u8]) -> Option<u64> {
        let bytes = record.get(self.offset..self.offset.checked_add(self.size)?)?;
        let mut le = [0u8; 8];
        match self.size {
            1 | 2 | 4 | 8 => le.get_mut(..self.size)?.copy_from_slice(bytes),
            _ => return None,
        }
        Some(u64::from_le_bytes(le))
    }

    /// The field as a signed integer, sign-extended from its size when the kernel marks it
    /// signed (zero-extended otherwise).
    #[must_use]
    pub fn signed_value(&self, record: &[u8]) -> Option<i64> {
        let raw = self.unsigned(record)?;
        let bits = u32::try_from(self.size * 8).ok()?;
        if self.signed && bits < 64 {
            let shift = 64 - bits;
            // Shifting left then arithmetic right by the unused bits sign-extends the value.
            Some((i64::from_ne_bytes(raw.to_ne_bytes()) << shift) >> shift)
        } else {
            Some(i64::from_ne_bytes(raw.to_ne_bytes()))
        }
    }
}

/// An event's record layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventFormat {
    /// The event name (`kvm_pio`).
    pub name: String,
    /// The numeric id records carry in `common_type`.
    pub id: u16,
    /// Every field, common ones first, in the order listed.
    pub fields: Vec<Field>,
}

impl EventFormat {
    /// Parses a `format` description.
    ///
    /// # Errors
    /// [`FormatError`] naming the line that could not be read, or the missing `name:`/`ID:`.
    pub fn parse(text: &str) -> Result<Self, FormatError> {
        let mut name = None;
        let mut id = None;
        let mut fields = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            let bad = |reason| FormatError::Line {
                line: i + 1,
                reason,
                text: raw.to_owned(),
            };
            if let Some(n) = line.strip_prefix("name:") {
                name = Some(n.trim().to_owned());
            } else if let Some(n) = line.strip_prefix("ID:") {
                id = Some(
                    n.trim()
                        .parse::<u16>()
                        .map_err(|_| bad("ID is not a u16"))?,
                );
            } else if line.starts_with("field:") {
                fields.push(parse_field(line).ok_or_else(|| bad("not a field description"))?);
            } else if line.starts_with("print fmt:") {
                // The print format follows the fields and is not needed to decode a record.
                break;
            }
        }
        Ok(Self {
            name: name.ok_or(FormatError::Missing("name:"))?,
            id: id.ok_or(FormatError::Missing("ID:"))?,
            fields,
        })
    }

    /// The field called `name`.
    #[must_use]
    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }
}

/// `field:<declaration>;\toffset:N;\tsize:N;\tsigned:N;`
fn parse_field(line: &str) -> Option<Field> {
    let mut parts = line.split(';').map(str::trim);
    let declaration = parts.next()?.strip_prefix("field:")?.trim().to_owned();
    let mut number = |key: &str| {
        parts
            .next()?
            .strip_prefix(key)?
            .trim()
            .parse::<usize>()
            .ok()
    };
    let offset = number("offset:")?;
    let size = number("size:")?;
    let signed = number("signed:")? != 0;
    // The name is the declaration's last word, without an array suffix (`comm[16]`).
    let last = declaration.split_ascii_whitespace().next_back()?;
    let name = last.split('[').next()?.trim_start_matches('*').to_owned();
    if name.is_empty() {
        return None;
    }
    Some(Field {
        name,
        declaration,
        offset,
        size,
        signed,
    })
}

/// The direction of a port access, as `kvm_pio`'s `rw` field gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PioDirection {
    /// The guest read the port (`in`).
    In,
    /// The guest wrote the port (`out`).
    Out,
}

/// One decoded `kvm:kvm_pio` record: a guest port access that exited to the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvmPio {
    /// The host thread that ran the vCPU (the record's `common_pid`).
    pub pid: u32,
    /// `in` or `out`.
    pub direction: PioDirection,
    /// The I/O port.
    pub port: u16,
    /// Access width in bytes.
    pub size: u32,
    /// Repetitions (`rep ins/outs`); `val` is the first one's value.
    pub count: u32,
    /// The value written, or read (see `docs/ftrace.md` for when a read's value is known).
    pub val: u32,
}

/// The `kvm_pio` fields located once in an [`EventFormat`], for decoding many records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvmPioLayout {
    /// The event id records carry in `common_type`.
    pub id: u16,
    common_type: Field,
    pid: Field,
    rw: Field,
    port: Field,
    size: Field,
    count: Field,
    val: Field,
}

/// The event's name in the `kvm` system.
pub const KVM_PIO: &str = "kvm_pio";

impl KvmPioLayout {
    /// Locates the fields `kvm_pio` records need.
    ///
    /// # Errors
    /// [`FormatError::Field`] when a field is missing or wider than 8 bytes.
    pub fn new(format: &EventFormat) -> Result<Self, FormatError> {
        let get = |field: &'static str| -> Result<Field, FormatError> {
            let problem = |problem| FormatError::Field {
                event: format.name.clone(),
                field,
                problem,
            };
            let f = format.field(field).ok_or_else(|| problem("is missing"))?;
            if ![1, 2, 4, 8].contains(&f.size) {
                return Err(problem("is not 1, 2, 4 or 8 bytes wide"));
            }
            Ok(f.clone())
        };
        Ok(Self {
            id: format.id,
            common_type: get("common_type")?,
            pid: get("common_pid")?,
            rw: get("rw")?,
            port: get("port")?,
            size: get("size")?,
            count: get("count")?,
            val: get("val")?,
        })
    }

    /// Decodes one record (starting at `common_type`). `None` when the record is another
    /// event's, too short, or holds values out of their range (a port above 16 bits, a pid
    /// that is not a thread id): untrusted bytes are never guessed into a sample.
    #[must_use]
    pub fn decode(&self, record: &[u8]) -> Option<KvmPio> {
        if self.common_type.unsigned(record)? != u64::from(self.id) {
            return None;
        }
        let narrow = |f: &Field| u32::try_from(f.unsigned(record)?).ok();
        let pid = u32::try_from(self.pid.signed_value(record)?).ok()?;
        let direction = match self.rw.unsigned(record)? {
            0 => PioDirection::In,
            _ => PioDirection::Out,
        };
        Some(KvmPio {
            pid,
            direction,
            port: u16::try_from(self.port.unsigned(record)?).ok()?,
            size: narrow(&self.size)?,
            count: narrow(&self.count)?,
            val: narrow(&self.val)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The description this project's host kernel (6.18) gives, verbatim.
    pub(crate) const KVM_PIO_FORMAT: &str = "name: kvm_pio
ID: 110
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned int rw;\toffset:8;\tsize:4;\tsigned:0;
\tfield:unsigned int port;\toffset:12;\tsize:4;\tsigned:0;
\tfield:unsigned int size;\toffset:16;\tsize:4;\tsigned:0;
\tfield:unsigned int count;\toffset:20;\tsize:4;\tsigned:0;
\tfield:unsigned int val;\toffset:24;\tsize:4;\tsigned:0;

print fmt: \"pio_%s at 0x%x size %d count %d val 0x%x %s\", REC->rw ? \"write\" : \"read\", REC->port, REC->size, REC->count, REC->val, REC->count > 1 ? \"(...)\" : \"\"
";

    /// A kvm_pio record (type 110, its pid at 4) whose own fields, `rw`, `port`, `size`,
    /// `count` and `val` (4 bytes each), start at `at`.
    fn kvm_pio_record(at: usize, pid: i32, fields: [u32; 5]) -> Vec<u8> {
        let mut r = vec![0u8; at + 4 * fields.len()];
        r[..2].copy_from_slice(&110u16.to_le_bytes());
        r[4..8].copy_from_slice(&pid.to_le_bytes());
        for (word, v) in r[at..].chunks_exact_mut(4).zip(fields) {
            word.copy_from_slice(&v.to_le_bytes());
        }
        r
    }

    #[test]
    fn parses_the_kernels_kvm_pio_description() {
        let f = EventFormat::parse(KVM_PIO_FORMAT).unwrap();
        assert_eq!(f.name, "kvm_pio");
        assert_eq!(f.id, 110);
        assert_eq!(f.fields.len(), 9);
        let port = f.field("port").unwrap();
        assert_eq!((port.offset, port.size, port.signed), (12, 4, false));
        assert_eq!(port.declaration, "unsigned int port");
        assert!(f.field("common_pid").unwrap().signed);
    }

    #[test]
    fn decodes_a_record_through_its_description() {
        let layout = KvmPioLayout::new(&EventFormat::parse(KVM_PIO_FORMAT).unwrap()).unwrap();
        let r = kvm_pio_record(8, 4242, [1, 0x3f8, 1, 1, 0x5a]);
        assert_eq!(
            layout.decode(&r),
            Some(KvmPio {
                pid: 4242,
                direction: PioDirection::Out,
                port: 0x3f8,
                size: 1,
                count: 1,
                val: 0x5a,
            })
        );
        // Another event's record, a short record and a port beyond 16 bits are refused.
        let mut other = r.clone();
        other[0] = 111;
        assert_eq!(layout.decode(&other), None);
        assert_eq!(layout.decode(&r[..27]), None);
        let mut wide = r.clone();
        wide[12..16].copy_from_slice(&0x1_0000u32.to_le_bytes());
        assert_eq!(layout.decode(&wide), None);
        let mut negative = r;
        negative[4..8].copy_from_slice(&(-1i32).to_le_bytes());
        assert_eq!(layout.decode(&negative), None);
    }

    #[test]
    fn a_moved_field_is_read_where_the_description_says() {
        // A kernel whose common header grew by 4 bytes moves every field: offsets are never
        // compiled in.
        let moved = KVM_PIO_FORMAT
            .replace("offset:24;", "offset:28;")
            .replace("offset:20;", "offset:24;")
            .replace("offset:16;", "offset:20;")
            .replace("offset:12;", "offset:16;")
            .replace("offset:8;", "offset:12;");
        let layout = KvmPioLayout::new(&EventFormat::parse(&moved).unwrap()).unwrap();
        let r = kvm_pio_record(12, 7, [0, 0x510, 1, 1, 9]);
        let pio = layout.decode(&r).unwrap();
        assert_eq!(
            (pio.port, pio.direction, pio.val),
            (0x510, PioDirection::In, 9)
        );
    }

    #[test]
    fn array_and_data_loc_fields_are_named_without_their_suffix() {
        let text = "name: sched_switch\nID: 316\nformat:\n\
            \tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\
            \tfield:__data_loc char[] name;\toffset:24;\tsize:4;\tsigned:0;\n";
        let f = EventFormat::parse(text).unwrap();
        assert_eq!(f.field("prev_comm").unwrap().size, 16);
        assert_eq!(f.field("name").unwrap().offset, 24);
    }

    #[test]
    fn bad_descriptions_name_their_line() {
        let e = EventFormat::parse("name: x\nID: 70000\n").unwrap_err();
        assert!(matches!(e, FormatError::Line { line: 2, .. }), "{e}");
        let e =
            EventFormat::parse("name: x\nID: 1\n\tfield:int a;\toffset:x;\tsize:4;\tsigned:1;\n")
                .unwrap_err();
        assert!(matches!(e, FormatError::Line { line: 3, .. }), "{e}");
        assert_eq!(
            EventFormat::parse("ID: 1\n").unwrap_err(),
            FormatError::Missing("name:")
        );
        let no_val = EventFormat::parse(&KVM_PIO_FORMAT.replace("val;", "value;")).unwrap();
        let e = KvmPioLayout::new(&no_val).unwrap_err();
        assert!(e.to_string().contains("field val is missing"), "{e}");
    }

    #[test]
    fn signed_fields_sign_extend() {
        let f = Field {
            name: "x".into(),
            declaration: "short x".into(),
            offset: 0,
            size: 2,
            signed: true,
        };
        assert_eq!(f.signed_value(&(-3i16).to_le_bytes()), Some(-3));
        assert_eq!(f.unsigned(&(-3i16).to_le_bytes()), Some(0xfffd));
        let odd = Field { size: 3, ..f };
        assert_eq!(odd.unsigned(&[1, 2, 3]), None);
    }
}
