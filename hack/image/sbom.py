"""SPDX 2.3 (JSON) software bill of materials of the operator image, from what is really in it.

    python3 hack/image/sbom.py --dpkg ROOTFS/var/lib/dpkg --freeze requirements.txt \
        --name batchtune --version 0.1.0 --revision SHA --epoch SOURCE_DATE_EPOCH > sbom.spdx.json

Packages: every Debian package dpkg records in the root filesystem (name, version, architecture, as
`pkg:deb/debian/...` purls) and every Python distribution `pip list --format=freeze` reports in the
venv (`pkg:pypi/...`), batchtune itself as the described package. Deterministic: sorted, and the
creation time is SOURCE_DATE_EPOCH, so the same image gives the same document byte for byte.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path


def spdx_id(kind: str, name: str, version: str) -> str:
    return "SPDXRef-" + re.sub(r"[^A-Za-z0-9.-]+", "-", f"{kind}-{name}-{version}")


def debian_packages(admindir: Path) -> list[tuple[str, str, str]]:
    out = subprocess.run(["dpkg-query", f"--admindir={admindir}", "-W", "-f", "${Package}\t${Version}\t${Architecture}\n"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(tuple(line.split("\t")) for line in out.splitlines() if line.count("\t") == 2)  # type: ignore[misc]


def python_packages(freeze: Path) -> list[tuple[str, str]]:
    rows = []
    for line in freeze.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            rows.append((name, version))
    return sorted(rows, key=lambda r: r[0].lower())


def document(name: str, version: str, revision: str, epoch: int, debs: list[tuple[str, str, str]],
             wheels: list[tuple[str, str]]) -> dict:
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    top = spdx_id("Image", name, version)
    packages = [{
        "SPDXID": top, "name": name, "versionInfo": version, "downloadLocation": "NOASSERTION",
        "filesAnalyzed": False, "licenseConcluded": "Apache-2.0", "licenseDeclared": "Apache-2.0",
        "copyrightText": "NOASSERTION", "primaryPackagePurpose": "CONTAINER",
        "comment": f"source revision {revision}"}]
    relationships = [{"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES", "relatedSpdxElement": top}]
    for pkg, ver, arch in debs:
        ref = spdx_id("Deb", pkg, ver)
        packages.append({
            "SPDXID": ref, "name": pkg, "versionInfo": ver, "downloadLocation": "NOASSERTION", "filesAnalyzed": False,
            "licenseConcluded": "NOASSERTION", "licenseDeclared": "NOASSERTION", "copyrightText": "NOASSERTION",
            "supplier": "Organization: Debian",
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:deb/debian/{pkg}@{ver}?arch={arch}&distro=bookworm"}]})
        relationships.append({"spdxElementId": top, "relationshipType": "CONTAINS", "relatedSpdxElement": ref})
    for pkg, ver in wheels:
        ref = spdx_id("PyPI", pkg, ver)
        packages.append({
            "SPDXID": ref, "name": pkg, "versionInfo": ver, "downloadLocation": "NOASSERTION", "filesAnalyzed": False,
            "licenseConcluded": "NOASSERTION", "licenseDeclared": "NOASSERTION", "copyrightText": "NOASSERTION",
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:pypi/{pkg.lower()}@{ver}"}]})
        relationships.append({"spdxElementId": top, "relationshipType": "CONTAINS", "relatedSpdxElement": ref})
    return {
        "spdxVersion": "SPDX-2.3", "dataLicense": "CC0-1.0", "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"{name}-{version}-image",
        "documentNamespace": f"https://batchtune.io/spdx/{name}-{version}-{revision}",
        "creationInfo": {"created": created, "creators": ["Tool: batchtune-hack-image-sbom"]},
        "packages": packages, "relationships": relationships}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dpkg", type=Path, required=True, help="the image's /var/lib/dpkg")
    p.add_argument("--freeze", type=Path, required=True, help="pip list --format=freeze of the image's venv")
    p.add_argument("--name", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--revision", required=True)
    p.add_argument("--epoch", type=int, required=True)
    a = p.parse_args()
    doc = document(a.name, a.version, a.revision, a.epoch, debian_packages(a.dpkg), python_packages(a.freeze))
    json.dump(doc, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
