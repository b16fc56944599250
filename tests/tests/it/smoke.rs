use vmtsync_tests::{have_kvm, require};

/// Every tier-2 test stands on a working `/dev/kvm`: it must open and speak KVM API version 12
/// (the only stable version, `KVM_API_VERSION` in linux/kvm.h).
#[test]
fn kvm_device_is_usable() {
    if !require(
        "kvm_device_is_usable",
        have_kvm(),
        "/dev/kvm is not accessible read-write",
    ) {
        return;
    }
    let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
    assert_eq!(kvm.get_api_version(), 12);
}
