use vmtsync_tests::{have_kvm, require};

crate::trials!(kvm; kvm_device_is_usable);

/// The test's prerequisite: `/dev/kvm` opens read-write.
fn kvm(test: &str) -> bool {
    require(test, have_kvm(), "/dev/kvm is not accessible read-write")
}

/// Every tier-2 test stands on a working `/dev/kvm`: it must open and speak KVM API version 12
/// (the only stable version, `KVM_API_VERSION` in linux/kvm.h).
fn kvm_device_is_usable() {
    let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
    assert_eq!(kvm.get_api_version(), 12);
}
