//! The trace.dat reader (`vmtsync::formats::tracedat::reader`): arbitrary bytes as a trace.dat, read
//! for its layout and every event. A panic or a hang is a crash; any damage must be an error
//! (with the offset where parsing failed), never a wrong success: a file the reader accepts is
//! read again with the same result.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmtsync::formats::tracedat::verify_file;

/// One scratch file per fuzzing process, in memory-backed /dev/shm when there is one: the
/// reader takes a path (it reads pages at offsets, like trace-cmd).
fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("vmtsync-fuzz-tracedat-{}.dat", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    if std::fs::write(path, data).is_err() {
        return;
    }
    if let Ok((layout, events)) = verify_file(path) {
        let (again, n) = verify_file(path).expect("an accepted file reads again");
        assert_eq!((again.buffers.len(), n), (layout.buffers.len(), events));
    }
});
