//! The 16550 link over [`FakePorts`]: the exact port accesses in both [`TxOrder`]s (what the
//! host's exit anchoring sees), non-blocking receive, and frames interleaved with console
//! text on one wire.

use core::fmt::Write as _;
use std::boxed::Box;
use std::vec::Vec;

use proptest::prelude::*;

use super::*;
use crate::agent::{Agent, AgentState};
use crate::arch::clock::TscClock;
use crate::arch::kvm_abi::PvclockVcpuTimeInfo;
use crate::arch::{FakePorts, FakeTsc, PortAccess, Tsc};
use crate::proto::{
    ErrorCode, Features, Hello, MAX_FRAME_SIZE, Message, PROTOCOL_VERSION, ProbeReplyFull,
    decode_frame, encode_frame,
};

const BASE: u16 = 0x3f8;
const THR: u16 = BASE + regs::THR;
const LSR: u16 = BASE + regs::LSR;
const THRE: u8 = regs::LSR_THRE | regs::LSR_TEMT;

fn out(port: u16, value: u8) -> PortAccess {
    PortAccess::Out { port, value }
}

fn inb(port: u16, value: u8) -> PortAccess {
    PortAccess::In { port, value }
}

fn uart(ports: &FakePorts, order: TxOrder) -> Uart16550<&FakePorts> {
    Uart16550::with_ports(ports, BASE).with_tx_order(order)
}

/// The accesses of one byte `b` sent while the UART takes `busy` status polls per byte:
/// write-then-wait writes first and polls after; wait-then-write polls first (`thr_was_busy`:
/// whether the previous byte still occupies THR) and writes after.
fn byte_accesses(order: TxOrder, b: u8, busy: u8, thr_was_busy: bool) -> Vec<PortAccess> {
    let polls = |n: u8| {
        let mut v: Vec<PortAccess> = (0..n).map(|_| inb(LSR, 0)).collect();
        v.push(inb(LSR, THRE));
        v
    };
    match order {
        TxOrder::WriteThenWait => {
            let mut v = std::vec![out(THR, b)];
            v.extend(polls(busy));
            v
        }
        TxOrder::WaitThenWrite => {
            let mut v = polls(if thr_was_busy { busy } else { 0 });
            v.push(out(THR, b));
            v
        }
    }
}

#[test]
fn init_programs_8n1_fifo_no_interrupts_then_waits_for_thr() {
    let ports = FakePorts::with_uart(BASE);
    uart(&ports, TxOrder::WriteThenWait).init();
    assert_eq!(
        ports.accesses().as_slice(),
        [
            out(BASE + 1, 0),
            out(BASE + 3, 0x80),
            out(BASE, 1),
            out(BASE + 1, 0),
            out(BASE + 3, 0x03),
            out(BASE + 2, 0x07),
            out(BASE + 4, 0x03),
            inb(LSR, THRE),
        ]
    );
    assert!(
        ports.tx().is_empty(),
        "the divisor latch write is not a byte on the wire"
    );
}

#[test]
fn send_writes_a_leading_delimiter_and_the_frame_in_either_order() {
    for order in [TxOrder::WriteThenWait, TxOrder::WaitThenWrite] {
        let ports = FakePorts::with_uart(BASE);
        ports.set_tx_busy_reads(2);
        let mut u = uart(&ports, order);
        u.send(&[0x11, 0x22, 0x00]).expect("a UART never refuses");
        let mut expected = Vec::new();
        for (i, b) in [0x00, 0x11, 0x22, 0x00].into_iter().enumerate() {
            expected.extend(byte_accesses(order, b, 2, i > 0));
        }
        assert_eq!(
            ports.accesses().as_slice(),
            expected.as_slice(),
            "{order:?}"
        );
        assert_eq!(ports.tx().as_slice(), [0, 0x11, 0x22, 0], "{order:?}");
        assert_eq!(
            ports.busy_writes(),
            0,
            "{order:?}: never a write into a full THR"
        );
    }
}

/// Over a whole agent: the host trusts only that the `in` of the request's last byte precedes
/// the TSC read and the `out` of the reply's first byte follows it. Write-then-wait goes
/// further: no port access at all between the read and that `out`; wait-then-write has only
/// LSR polls there.
#[test]
fn probe_reply_accesses_around_the_tsc_read() {
    const READ: u32 = 7;
    struct MarkingTsc<'a>(&'a FakePorts, FakeTsc);
    impl Tsc for MarkingTsc<'_> {
        fn read_ordered(&self) -> u64 {
            self.0.mark(READ);
            self.1.read_ordered()
        }
    }
    for order in [TxOrder::WriteThenWait, TxOrder::WaitThenWrite] {
        let ports = FakePorts::with_uart(BASE);
        ports.set_tx_busy_reads(1);
        let u = uart(&ports, order);
        u.init();
        let clock: TscClock<_, &FakePorts, PvclockVcpuTimeInfo> =
            TscClock::new(MarkingTsc(&ports, FakeTsc::new(5_000, 3)), 0);
        let mut agent = Agent::new(u, clock);
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            features: Features::NONE,
        });
        assert!(ports.push_rx(encode_frame(&hello, &mut buf).expect("fits")));
        assert_eq!(agent.poll().map(|p| p.state), Ok(AgentState::Ready));
        ports.clear_log();
        ports.clear_tx();

        let request = encode_frame(&Message::ProbeFull { seq: 9 }, &mut buf).expect("fits");
        let last = *request.last().expect("a frame");
        assert!(ports.push_rx(request));
        agent.poll().expect("the fake never fails");
        let log = ports.accesses();
        let read = log
            .iter()
            .position(|a| *a == PortAccess::Mark(READ))
            .expect("the probe read the TSC");
        let last_in = log
            .iter()
            .rposition(|a| matches!(a, PortAccess::In { port: BASE, .. }))
            .expect("the request was read");
        assert_eq!(log[last_in], inb(BASE, last), "{order:?}");
        assert!(
            last_in < read,
            "{order:?}: the request's last byte is read first"
        );
        let first_out = log
            .iter()
            .position(|a| matches!(a, PortAccess::Out { port: THR, .. }))
            .expect("a reply");
        assert!(
            read < first_out,
            "{order:?}: the reply's first byte follows the read"
        );
        let between = &log[read + 1..first_out];
        match order {
            TxOrder::WriteThenWait => assert!(between.is_empty(), "{between:?}"),
            TxOrder::WaitThenWrite => {
                assert!(!between.is_empty());
                assert!(
                    between
                        .iter()
                        .all(|a| matches!(a, PortAccess::In { port: LSR, .. })),
                    "{between:?}"
                );
            }
        }
        let mut tx = ports.tx();
        assert_eq!(tx.first(), Some(&0), "the leading delimiter");
        assert_eq!(
            decode_frame(&mut tx[1..]),
            Ok(Message::ProbeReplyFull(ProbeReplyFull {
                seq: 9,
                vcpu: 0,
                tsc: 5_003,
            })),
            "{order:?}"
        );
    }
}

#[test]
fn recv_never_waits_and_takes_at_most_the_buffer() {
    let ports = FakePorts::with_uart(BASE);
    let mut u = uart(&ports, TxOrder::WriteThenWait);
    let mut buf = [0u8; 2];
    assert_eq!(u.recv(&mut buf), Ok(0));
    assert_eq!(
        ports.accesses().as_slice(),
        [inb(LSR, THRE)],
        "one status read"
    );
    ports.clear_log();
    assert!(ports.push_rx(&[5, 6, 7]));
    assert_eq!(u.recv(&mut buf), Ok(2));
    assert_eq!(buf, [5, 6]);
    assert_eq!(
        ports.accesses().as_slice(),
        [
            inb(LSR, regs::LSR_DR | THRE),
            inb(BASE, 5),
            inb(LSR, regs::LSR_DR | THRE),
            inb(BASE, 6),
        ],
        "a full buffer ends the call without another status read"
    );
    assert_eq!(ports.rx_len(), 1, "the rest waits in the UART");
    assert_eq!(u.recv(&mut buf), Ok(1));
    assert_eq!(buf[0], 7);
    assert_eq!(u.recv(&mut []), Ok(0));
    assert!(ports.tx().is_empty(), "receiving writes nothing");
}

#[test]
fn console_text_goes_out_byte_for_byte_in_the_configured_order() {
    for order in [TxOrder::WriteThenWait, TxOrder::WaitThenWrite] {
        let ports = FakePorts::with_uart(BASE);
        ports.set_tx_busy_reads(1);
        let mut u = uart(&ports, order);
        writeln!(u, "boot {}", 42).expect("a UART never fails");
        assert_eq!(ports.tx().as_slice(), b"boot 42\n", "{order:?}");
        assert_eq!(ports.busy_writes(), 0, "{order:?}");
        if order == TxOrder::WriteThenWait {
            assert_eq!(
                ports.accesses().last(),
                Some(&inb(LSR, THRE)),
                "text leaves THR empty for the next frame"
            );
        }
    }
}

/// What the host makes of the wire (the shared-UART rule): split on `0x00`; a run that
/// decodes is a message, any other non-empty run is console text.
#[derive(Debug, PartialEq)]
enum Run {
    Frame(Box<Message>),
    Text(Vec<u8>),
}

fn split_wire(wire: &[u8]) -> Vec<Run> {
    let mut runs = Vec::new();
    for run in wire.split(|&b| b == 0).filter(|r| !r.is_empty()) {
        let mut frame = run.to_vec();
        frame.push(0);
        match decode_frame(&mut frame) {
            Ok(m) => runs.push(Run::Frame(Box::new(m))),
            Err(_) => runs.push(Run::Text(run.to_vec())),
        }
    }
    runs
}

#[derive(Clone, Debug)]
enum Op {
    Text(std::string::String),
    Frame(Box<Message>),
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u8>(), any::<u32>(), any::<u64>()).prop_map(|(seq, vcpu, tsc)| {
            Message::ProbeReplyFull(ProbeReplyFull { seq, vcpu, tsc })
        }),
        any::<u32>().prop_map(|vcpu| Message::MappingApplied { vcpu }),
        Just(Message::Error(ErrorCode::Malformed)),
        Just(Message::Exiting),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Console text: printable ASCII and newlines, never a NUL.
        "[ -~\n]{0,40}".prop_map(Op::Text),
        message().prop_map(|m| Op::Frame(Box::new(m))),
    ]
}

proptest! {
    /// Frames and console text interleaved at random on one UART, in either order, with the
    /// transmitter slow or fast: every frame comes out, in order, and the text between two
    /// frames comes out byte for byte as one run.
    #[test]
    fn frames_and_text_interleaved_all_come_out(
        ops in proptest::collection::vec(op(), 0..24),
        wait_then_write in any::<bool>(),
        busy in 0u32..3,
    ) {
        let order = if wait_then_write { TxOrder::WaitThenWrite } else { TxOrder::WriteThenWait };
        let ports = FakePorts::with_uart(BASE);
        ports.set_tx_busy_reads(busy);
        let mut u = uart(&ports, order);
        u.init();
        let mut expected: Vec<Run> = Vec::new();
        let mut buf = [0u8; MAX_FRAME_SIZE];
        for op in &ops {
            match op {
                Op::Text(t) => {
                    u.write_str(t).expect("a UART never fails");
                    match expected.last_mut() {
                        Some(Run::Text(prev)) => prev.extend_from_slice(t.as_bytes()),
                        _ if !t.is_empty() => expected.push(Run::Text(t.as_bytes().to_vec())),
                        _ => {}
                    }
                }
                Op::Frame(m) => {
                    u.send(encode_frame(m, &mut buf).expect("fits")).expect("never refused");
                    expected.push(Run::Frame(m.clone()));
                }
            }
        }
        prop_assert_eq!(split_wire(&ports.tx()), expected);
        prop_assert_eq!(ports.busy_writes(), 0);
    }
}
