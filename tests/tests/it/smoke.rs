use vmtsync_tests::{have_kvm, require};

#[test]
fn kvm_device_is_usable() {
    if !require(
        "kvm_device_is_usable",
        have_kvm(),
        "/dev/kvm is not accessible read-write",
    ) {
        return;
    }
    assert!(std::path::Path::new("/dev/kvm").exists());
}
