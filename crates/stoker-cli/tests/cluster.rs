//! The cluster in a box (scripts/cluster.sh): two ranks in their own network namespaces,
//! joined through a bridge by veth links shaped with tc. `stoker bench comm` between them
//! must see the configured link rate: all_reduce bus bandwidth within 10% of it, at two
//! rates, so the traffic really crosses the shaped links (a run that used shared memory
//! would see GB/s). The rates are low enough (400 and 200 Mbit/s) that the shaper, not
//! this machine's speed, sets the figure: this is a check of the setup, not a benchmark.
//! Where namespaces cannot be made (no CAP_NET_ADMIN), the test says SKIPPED loudly.

use std::path::Path;
use std::process::Command;

const STOKER: &str = env!("CARGO_BIN_EXE_stoker");

/// all_reduce bus bandwidths (GB/s) by buffer size over a shaped 2-rank cluster, or None
/// when the machine cannot make namespaces.
fn all_reduce_busbw(rate: &str, json: &Path) -> Option<Vec<(u64, f64)>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/cluster.sh");
    let o = Command::new("bash")
        .args([
            script,
            "-n",
            "2",
            "--rate",
            rate,
            "--timeout",
            "120",
            "--",
            STOKER,
        ])
        .args([
            "bench",
            "comm",
            "--min-kib",
            "4096",
            "--max-mib",
            "16",
            "--seconds",
            "0.5",
        ])
        .arg("--json")
        .arg(json)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.code() == Some(77) {
        stoker_testkit::skip("cluster_in_a_box", err.trim());
        return None;
    }
    assert!(o.status.success(), "cluster.sh failed: {err}");
    let rows: serde_json::Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    Some(
        rows.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["op"] == "all_reduce")
            .map(|r| {
                (
                    r["bytes"].as_u64().unwrap(),
                    r["stoker_busbw_gbs"].as_f64().unwrap(),
                )
            })
            .collect(),
    )
}

#[test]
fn all_reduce_over_a_shaped_link_runs_at_the_link_rate() {
    let tmp = tempfile::tempdir().unwrap();
    for (rate, gbyte_s) in [("400mbit", 0.05), ("200mbit", 0.025)] {
        let Some(rows) = all_reduce_busbw(rate, &tmp.path().join(format!("{rate}.json"))) else {
            return;
        };
        assert_eq!(rows.len(), 2, "{rows:?}");
        for &(bytes, busbw) in &rows {
            eprintln!(
                "{rate}: all_reduce {bytes} B: {busbw:.4} GB/s, {:.3} of the link",
                busbw / gbyte_s
            );
        }
        // Bandwidth is the large-message figure (as nccl-tests report it): 16 MiB, where
        // TCP's ramp after each idle gap no longer counts.
        // tc counts whole frames: at MTU 1500 a TCP segment carries 1448 bytes of payload
        // (timestamps on) in a 1514-byte frame, so the most a link of rate R can carry is
        // R x 1448 / 1514 = 0.956 R of data.
        let (bytes, busbw) = rows[1];
        let ratio = busbw / (gbyte_s * 1448.0 / 1514.0);
        assert!(
            (0.9..=1.1).contains(&ratio),
            "{rate}: all_reduce of {bytes} B ran at {busbw} GB/s, {ratio:.3} of the link's TCP payload rate"
        );
    }
}
